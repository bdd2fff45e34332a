"""The package's layout: layers import only from the layers below them (so no cycle), the schema imports
nothing of the runtime, and docs/ARCHITECTURE.md names every module there is."""

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "compile_trainer"
# Bottom first: a module may import from its own layer and the layers before it.
LAYERS = ["compat", "tables", "schema", "planning", "compiling", "cache", "shapes", "optimizer", "telemetry",
          "lightning", "runs", "cli"]  # fmt: skip
TOP = ["__init__", "__main__"]


def layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def imports(path: Path):
    """compile_trainer modules ``path`` imports, at any depth (function-level imports count too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("compile_trainer"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            yield from (n if node.module == "compile_trainer" else node.module for n in names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("compile_trainer"))


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path


def test_layers_import_only_from_layers_below_them():
    wrong = []
    for name, path in modules():
        layer = layer_of(name)
        if layer in TOP:
            continue
        for imported in imports(path):
            target = layer_of(imported)
            if target in TOP or LAYERS.index(target) > LAYERS.index(layer):
                wrong.append(f"{name} imports {imported}")
    assert not wrong


def test_the_schema_imports_nothing_of_the_runtime():
    allowed = {"compile_trainer", "omegaconf", "__future__"} | set(sys.stdlib_module_names)
    found = []
    for name, path in modules():
        if layer_of(name) != "schema":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{name}: {root}" for root in roots if root.split(".")[0] not in allowed]
    assert not found, "torch, lightning or hydra in the schema layer"


def test_architecture_page_matches_the_tree():
    """One row per module (``| `folder/module.py` | ... |``), and one section per layer folder."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    on_disk = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"}
    on_disk.discard("__main__.py")
    named = set(re.findall(r"^\| `((?:[a-z_]+/)?[a-z_]+\.py)` \|", page, flags=re.M))
    assert named == on_disk, (sorted(on_disk - named), sorted(named - on_disk))
    sections = set(re.findall(r"^### `([a-z_]+)/`", page, flags=re.M))
    assert sorted(sections) == sorted(layer for layer in LAYERS if (PACKAGE / layer).is_dir())


def test_python_requirement_is_what_the_code_and_the_linter_assume():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11", "code.replace(co_qualname=...) needs Python 3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert sys.version_info >= (3, 11)
    packaged = set(project["tool"]["setuptools"]["packages"])
    folders = {f"compile_trainer.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= packaged, "every subpackage ships in the wheel"


MAX_MODULE_LINES = 400  # a module a reader can hold in mind
MAX_FUNCTION_LINES = 60  # in the layers whose functions decide (what to compile, how, when)
SHORT_FUNCTION_LAYERS = ("compiling", "planning", "lightning")


def test_rooms_stay_small():
    """No module over ``MAX_MODULE_LINES``, no function of the deciding layers over ``MAX_FUNCTION_LINES``: split a
    module by concern, a function into named steps, before either grows past them."""
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {source.count(chr(10))} lines")
        if path.parent.name in SHORT_FUNCTION_LAYERS:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        long_functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules and not long_functions, long_modules + long_functions
