"""Every private torch API the library reaches, probed on the installed torch (``compile_trainer.compat``).

A torch upgrade that moves or changes one of them fails here first, with the entry's name; raising the oldest
supported torch fails here until the code kept for the versions dropped is gone."""

import ast
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from compile_trainer import compat

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "compile_trainer"
DOOR = Path(compat.__file__).resolve().parent
DOOR_MODULES = [
    importlib.import_module(f"{compat.__name__}.{info.name}") for info in pkgutil.iter_modules(compat.__path__)
]


@pytest.mark.parametrize("entry", [e for e in compat.ENTRIES if e.present_from is None], ids=lambda e: e.name)
def test_each_private_torch_api_works_on_this_torch(entry):
    assert entry.probe() is None, "a probe asserts what it needs; a value it returned would be ignored"


@pytest.mark.parametrize("entry", [e for e in compat.ENTRIES if e.present_from is not None], ids=lambda e: e.name)
def test_versioned_entries_exist_from_their_version(entry):
    if compat.torch_version() < entry.present_from:
        assert compat.needs_torch(entry.name, entry.present_from) is not None
        with pytest.raises((AttributeError, ImportError, RuntimeError, AssertionError)):
            entry.probe()
    else:
        assert entry.probe() is None


def test_the_entries_are_gathered_from_every_module_of_the_door():
    """``compat.ENTRIES`` is every module's ``ENTRIES`` (a new module's entries probed too), each name once; every
    name a module exports is exported by the package."""
    gathered = [entry for module in DOOR_MODULES for entry in getattr(module, "ENTRIES", [])]
    assert sorted(e.name for e in compat.ENTRIES) == sorted(e.name for e in gathered)
    assert len({e.name for e in compat.ENTRIES}) == len(compat.ENTRIES)
    exported = {name for module in DOOR_MODULES for name in module.__all__} - {"ENTRIES"}
    assert exported <= set(compat.__all__) and all(getattr(compat, name) is not None for name in compat.__all__)


# Not entries: the version helpers, the records, and a class its entry's probe uses through its setter.
NOT_PROBED = {"torch_version", "needs_torch", "Entry", "Obsolete", "LoggerMethodName"}


def test_every_function_of_compat_is_used_by_a_probe():
    """A new door to torch's internals comes with a probe: each public name of compat appears in a probe's source."""
    sources = "\n".join(inspect.getsource(entry.probe) for entry in compat.ENTRIES)
    public = [
        name
        for module in DOOR_MODULES
        for name in module.__all__
        if name != "ENTRIES" and callable(getattr(module, name))
    ]
    assert not [name for name in public if name not in NOT_PROBED and not re.search(rf"\b{name}\b", sources)]


def _resolves(qualified: str) -> bool:
    """Whether torch has ``qualified``: its longest importable module, then attributes."""
    parts = qualified.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                value = getattr(value, part)
        except AttributeError:
            return False
        return True
    return False


TORCH_SYMBOL = re.compile(r"torch(\.[A-Za-z_]\w*)+")
CHECKED = re.compile(r"2\.\d+(\.\d+)?( \S.*)?")  # a torch version, then where: "2.11 H100"; the CPU without


@pytest.mark.parametrize("entry", compat.ENTRIES, ids=lambda e: e.name)
def test_every_entry_names_the_torch_symbols_it_reaches_and_the_versions_it_was_checked_on(entry):
    assert entry.reaches and all(TORCH_SYMBOL.fullmatch(name) for name in entry.reaches), entry.reaches
    if entry.present_from is None or compat.torch_version() >= entry.present_from:
        assert _resolves(entry.reaches[0]), f"{entry.name}: torch {torch.__version__} has no {entry.reaches[0]}"
    assert entry.checked and all(CHECKED.fullmatch(version) for version in entry.checked), entry.checked
    assert all(re.fullmatch(r"https://github\.com/pytorch/pytorch/(issues|pull)/\d+", url) for url in entry.upstream)
    assert all(obsolete.what and len(obsolete.torch) == 2 for obsolete in entry.obsolete), entry.obsolete


def oldest_supported_torch() -> tuple:
    """The oldest torch pyproject.toml declares (``torch>=X.Y``), as .ci/torch_versions.sh reads it."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (found,) = [m for r in dependencies if (m := re.fullmatch(r"torch>=(\d+)\.(\d+)", r))]
    return int(found.group(1)), int(found.group(2))


def obsolete_code(entries, oldest: tuple) -> list:
    """What the entries keep for torch versions older than ``oldest``: one line per piece, naming the entry."""
    return [
        f"{entry.name}: obsolete once torch >= {'.'.join(map(str, obsolete.torch))} is the oldest supported; "
        f"remove {obsolete.what}"
        for entry in entries
        for obsolete in entry.obsolete
        if oldest >= obsolete.torch
    ]


def test_no_entry_keeps_code_for_a_torch_older_than_the_oldest_supported():
    """Raising ``torch>=X.Y`` in pyproject.toml fails here until the code kept for the versions dropped is gone."""
    assert not obsolete_code(compat.ENTRIES, oldest_supported_torch()), "\n".join(
        obsolete_code(compat.ENTRIES, oldest_supported_torch())
    )


def test_the_oldest_supported_torch_is_the_one_ci_tests():
    """pyproject.toml's ``torch>=X.Y`` read here as .ci/torch_versions.sh reads it (its own snippet, run)."""
    script = (ROOT / ".ci" / "torch_versions.sh").read_text()
    snippet = re.search(r"oldest=\$\(python - <<'EOF'\n(.*?)\nEOF", script, flags=re.S).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{}.{}.*".format(*oldest_supported_torch())
    assert oldest_supported_torch() <= compat.torch_version(), "the installed torch is one the project supports"


def test_raising_the_oldest_torch_names_each_entry_it_makes_obsolete_and_what_to_remove():
    kept = compat.Entry(
        "kept_for_old_torch",
        lambda: None,
        reaches=("torch.compile",),
        checked=("2.13",),
        obsolete=(compat.Obsolete((2, 12), "the branch for torch 2.11"),),
    )
    assert obsolete_code([kept], (2, 11)) == []
    assert (
        obsolete_code([kept], (2, 12))
        == obsolete_code([kept], (2, 14))
        == ["kept_for_old_torch: obsolete once torch >= 2.12 is the oldest supported; remove the branch for torch 2.11"]
    )


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_torch_uses(source: str):
    """Private torch names a source reaches: ``torch._x`` attribute chains (also from a name bound to a torch module,
    ``from torch import nn``), imports of private modules (``import torch._x as y``, ``from torch import _dynamo``,
    ``from torch._x import y``), and ``getattr``/``hasattr``/``setattr``/``delattr`` of a private name on them."""
    tree = ast.parse(source)
    roots = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.asname or "torch" for alias in node.names if alias.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            roots |= {alias.asname or alias.name for alias in node.names}

    def rooted(expr) -> bool:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in roots

    for node in ast.walk(tree):
        where = f"(line {getattr(node, 'lineno', '?')})"
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and rooted(node.value):
            yield f"{ast.unparse(node)} {where}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_is_private(part) for part in parts):
                    yield f"import {alias.name} {where}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names = [alias.name for alias in node.names]
            if any(_is_private(part) for part in [*node.module.split("."), *names]):
                yield f"from {node.module} import {', '.join(names)} {where}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            target, name = node.args[:2]
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value)
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and literal and rooted(target):
                yield f"{ast.unparse(node)} {where}"


@pytest.mark.parametrize(
    "source, found",
    [
        ("import torch\ntorch._dynamo.reset()", True),
        ("import torch._dynamo as dynamo", True),
        ("import torch._inductor.config", True),
        ("from torch import _dynamo", True),
        ("from torch._dynamo.utils import counters", True),
        ("import torch\ngetattr(torch, '_dynamo')", True),
        ("import torch\nhasattr(torch._C, 'x')", True),
        ("import torch\nsetattr(torch.compiler, '_flag', 1)", True),
        ("import torch as t\nt._dynamo.reset()", True),
        ("from torch import nn\nnn.modules.module._global_forward_hooks", True),
        ("import torch\ntorch.compile(torch.nn.Linear(2, 2))", False),
        ("import torch\ngetattr(torch, 'float16')", False),
        ("from torch import nn\nnn.Module.__call__", False),
        ("x = object()\nx._private", False),
    ],
)
def test_the_private_api_guard_sees_every_way_to_reach_torch_internals(source, found):
    assert bool(list(private_torch_uses(source))) is found


def test_private_torch_apis_are_reached_only_through_compat():
    # Allowed: the pytree helpers (torch.utils._pytree) and the `torch._foreach_*` ops, ATen operators that
    # torch.optim itself calls; neither is compiler internals.
    allowed = re.compile(r"from torch\.utils\._pytree import |torch\._foreach_\w+ ")
    offenders = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if DOOR not in path.resolve().parents
        and (names := [n for n in private_torch_uses(path.read_text()) if not allowed.match(n)])
    }
    assert not offenders


def test_the_recompile_limit_a_policy_sets_is_restored_when_it_is_removed(tiny_gpt):
    from compile_trainer import apply_policy, to_policy

    before = torch._dynamo.config.recompile_limit
    applied = apply_policy(tiny_gpt, to_policy("regional", backend="eager", recompile_limit=before + 5))
    assert torch._dynamo.config.recompile_limit == before + 5
    applied.remove()
    assert torch._dynamo.config.recompile_limit == before


def test_an_ignored_logger_method_by_name_is_json_and_still_ignored_by_dynamo():
    """Torch up to 2.11 writes the ignore set into each compile's metrics as JSON (a function there loses every
    compile's metrics); the name stand-in is JSON and Dynamo still drops the call without a graph break."""
    import json
    import logging

    log = logging.getLogger("compile_trainer.test_compat")
    name = compat.LoggerMethodName.of(logging.Logger.warning)
    assert logging.Logger.warning in {name} and json.dumps(sorted({name})) == '["logging.Logger.warning"]'
    with pytest.raises(TypeError):
        json.dumps(sorted({logging.Logger.warning}))  # what torch <= 2.11 did with the function itself

    def noisy(x):
        log.warning("traced")
        return x + 1

    previous = torch._dynamo.config.ignore_logger_methods
    torch._dynamo.config.ignore_logger_methods = {name}
    try:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(noisy, backend="eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        torch._dynamo.config.ignore_logger_methods = previous
        torch._dynamo.reset()
    assert compat.dynamo_config_loggable()


def test_the_compiler_warmup_starts_for_inductor_policies_on_a_gpu_only(monkeypatch):
    """``CompileCallback(...)`` (and ``apply_policy``) begin Inductor's per-process start-up where the policy
    compiles with Inductor on a GPU (where it was measured to shorten the first step); a policy that compiles
    nothing, or only with other backends, and any policy on a machine without a GPU start nothing."""
    from compile_trainer import CompileCallback
    from compile_trainer.compiling.warmup import uses_inductor
    from compile_trainer.schema import to_policy

    assert uses_inductor(to_policy("regional")) and uses_inductor(to_policy("none", optimizer={"compile": "true"}))
    assert not uses_inductor(to_policy("regional", backend="aot_eager")) and not uses_inductor(to_policy("none"))
    monkeypatch.setattr(compat.inductor, "_compiler_keys_prefetched", False)
    CompileCallback("regional", backend="aot_eager")
    assert compat.inductor._compiler_keys_prefetched is False
    CompileCallback("regional")
    assert compat.inductor._compiler_keys_prefetched is torch.cuda.is_available()


FORKED_WORKERS = """
import os, sys
from concurrent.futures import ProcessPoolExecutor
from torch._inductor import config
from torch._inductor.async_compile import AsyncCompile
from compile_trainer import compat
chose = compat.fork_compile_workers()
pool = AsyncCompile.process_pool()
print(chose, config.worker_start_method, type(pool).__name__, compat.fork_compile_workers())
if isinstance(pool, ProcessPoolExecutor):
    assert pool.submit(os.getppid).result(timeout=60) == os.getpid(), "a worker is this process's child"
"""


@pytest.mark.parametrize("chosen", [None, "subprocess"])
def test_compile_workers_are_forked_unless_the_user_chose_a_start_method(chosen):
    """``fork_compile_workers`` makes Inductor's pool fork its workers from this process (ready in under a second
    on an H100 machine, against 10-23 s for a sidecar that imports torch first); a start method the user set in
    ``TORCHINDUCTOR_WORKER_START``, or a pool that exists already, is left as it is."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_WORKER_START"}
    env |= {"TORCHINDUCTOR_COMPILE_THREADS": "2"} | ({"TORCHINDUCTOR_WORKER_START": chosen} if chosen else {})
    done = subprocess.run([sys.executable, "-c", FORKED_WORKERS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    chose, method, pool, again = done.stdout.split()
    if chosen is None:
        assert (chose, method, pool, again) == ("True", "fork", "TrackedProcessPoolExecutor", "False")
    else:
        assert (chose, method, pool, again) == ("False", "subprocess", "SubprocPool", "False")
