"""Every example in README.md and docs/*.md runs here, so that none goes stale.

docs/BENCHMARKS.md is left out: ``benchmarks/make_report.py`` generates it from result files. Each fenced block is
handled by its language:

- ``python``: executed as a script of its own (a fresh namespace, a temporary working directory); README.md's as
  a user runs them: in an empty directory, in a process that can import this package only as installed (a wheel
  built from the checkout), which must warn about nothing and write nothing there;
- ``yaml``: parsed, then by what it is: a compile policy (``rules``, ``name`` or a ``defaults`` list) is written
  into a copy of ``conf/compile/``, composed by Hydra as ``train.py compile=<name>`` does, read from its path as
  ``CompileCallback("configs/compile/<name>.yaml")`` reads it (the same policy both ways), validated and applied
  with backend ``eager`` to the recipe's ``LanguageModel`` for one training step; a policy section (``shapes:``,
  ``optimizer:``, ...) is validated over the bundled ``regional``; a LightningCLI config (``trainer:``, ...) is
  instantiated by ``LightningCLI(run=False)`` with the recipe's model;
- ``bash``: each command, ``&&``-separated: ``python train.py ...`` is composed by Hydra (a multirun's sweeps
  expanded, every run) and checked as ``train.py`` checks before training; ``compile-trainer ...`` and ``python -m
  compile_trainer ...`` are parsed by the command's own parser (``explain``'s overrides composed too);
  ``python benchmarks/<script>.py ...`` must name a script that declares every option used; ``pip install`` (the
  extras must exist), ``python -m pytest`` (this suite; ``.ci/run`` runs the README's line) and ``wandb`` (needs a
  W&B server) are not run.

A block that cannot run here is marked on the line before its fence, with the reason:
``<!-- illustration: needs 8 GPUs -->``. Any other block, or a command no handler knows, fails.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from compile_trainer import CompileCallback, CompilePolicy, apply_policy, to_policy
from compile_trainer.cli.main import build_parser
from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.runs.training import build_callback
from compile_trainer.schema import bundled_policy_names, to_sweep_settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md")]
MARKER = re.compile(r"<!--\s*illustration:\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
LIST_ITEM = re.compile(r"^([-*+]|\d+\.) ")
POLICY_FIELDS = {f.name for f in fields(CompilePolicy)}
CLI_CONFIG_KEYS = {"trainer", "model", "data", "seed_everything", "optimizer", "lr_scheduler", "ckpt_path"}
TINY_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    text: str
    illustration: Optional[str]  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> List[Block]:
    lines = page.read_text().splitlines()
    blocks, index, paragraph = [], 0, ""  # paragraph: the last line at column 0 (is it a list item?)
    while index < len(lines):
        line = lines[index]
        assert not re.match(r"^\s+```", line), f"{page.name}:{index + 1}: an indented fence; start fences at column 0"
        after_blank = index > 0 and not lines[index - 1].strip()
        indented_code = line.startswith("    ") and after_blank and not LIST_ITEM.match(paragraph)
        assert not indented_code, f"{page.name}:{index + 1}: an indented code block; use a fence, which this test runs"
        paragraph = line if line.strip() and not line.startswith(" ") else paragraph
        opening = FENCE.match(line)
        if not opening:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.name}:{index + 1}: a fence that never closes"
        before = next((lines[j] for j in range(index - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        text = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(page, index + 1, opening["lang"], text, marker["reason"] if marker else None))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]


# ---------------------------------------------------------------------------------------------------- python


def run_python(block: Block) -> None:
    code = compile(block.text, block.id, "exec")
    try:
        exec(code, {"__name__": "__docs_example__"})
    finally:
        torch._dynamo.reset()


# Run around a README example in its own process: the example as `python example.py` runs it, with the
# interpreter's default warning filters (a user's), every warning and every log record at WARNING or above kept.
# Lightning advises on DataLoader workers from the machine's cores (none on two): the example runs as on a
# user's machine of 16 cores, wherever the test runs.
USER_RUN = """
import json, logging, runpy, sys, warnings

import lightning.fabric.utilities.data

lightning.fabric.utilities.data._num_cpus_available = lambda: 16
found = []
handle = logging.Logger.callHandlers


def keep_warnings(logger, record):
    if record.levelno >= logging.WARNING:
        found.append(f"log {record.name}: {record.getMessage()}")
    handle(logger, record)


logging.Logger.callHandlers = keep_warnings
with warnings.catch_warnings(record=True) as caught:
    runpy.run_path(sys.argv[1], run_name="__main__")
found += [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
import compile_trainer

json.dump({"warnings": found, "package": compile_trainer.__file__}, open(sys.argv[2], "w"))
"""

# Lightning 2.6 builds torch's pytree `LeafSpec`, which torch >= 2.13 deprecates with a FutureWarning: every
# `Trainer.fit` on those versions prints it, from Lightning's code, whatever the example does.
UPSTREAM_WARNINGS = re.compile(r"FutureWarning: `isinstance\(treespec, LeafSpec\)` is deprecated")
# The package's files as a wheel takes them (pyproject.toml's packages), copied so that the build writes nothing
# into the checkout.
PACKAGE_SOURCES = ["pyproject.toml", "README.md", "compile_trainer", "compile_trainer_recipes", "conf"]


@pytest.fixture(scope="module")
def installed_package(tmp_path_factory) -> Path:
    """The package as `pip install` gives it to a user, away from this checkout: a wheel built from it, unpacked."""
    build = tmp_path_factory.mktemp("build")
    source = build / "source"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    wheel_dir = build / "wheel"
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w"]
    subprocess.run([*command, str(wheel_dir)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("compile_trainer-*.whl")
    site = build / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return site


def run_python_as_a_user(block: Block, site: Path, tmp_path: Path) -> None:
    """The example as a user runs it: saved as a file, run in an empty directory by a Python that has the installed
    package and its dependencies, nothing of this checkout. It must warn about nothing and leave the directory
    empty."""
    scripts, empty = tmp_path / "scripts", tmp_path / "empty"
    scripts.mkdir()
    empty.mkdir()
    (scripts / "example.py").write_text(block.text)
    (scripts / "user_run.py").write_text(USER_RUN)
    report = scripts / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    command = [sys.executable, str(scripts / "user_run.py"), str(scripts / "example.py"), str(report)]
    result = subprocess.run(command, cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{block.id}: {result.stderr[-3000:]}"
    found = json.loads(report.read_text())
    assert Path(found["package"]).is_relative_to(site), "the installed package ran, not the checkout"
    warned = [w for w in found["warnings"] if not UPSTREAM_WARNINGS.search(w)]
    assert not warned, f"{block.id} warns: {warned}"
    printed = [line for line in (result.stdout + result.stderr).splitlines() if re.search(r"\bwarn", line, re.I)]
    assert not printed, f"{block.id} prints warnings: {printed}"
    written = sorted(str(p.relative_to(empty)) for p in empty.rglob("*"))
    assert not written, f"{block.id} wrote into the directory it ran in: {written}"


# ------------------------------------------------------------------------------------------------------ yaml


def run_yaml(block: Block, tmp_path: Path) -> None:
    config = yaml.safe_load(block.text)
    assert isinstance(config, dict), f"{block.id}: a YAML example must be a mapping"
    keys = set(config)
    if keys <= CLI_CONFIG_KEYS and keys & {"trainer", "model", "data"}:  # `optimizer:` alone is a policy section
        run_lightning_cli_config(block, config, tmp_path)
    elif keys & {"rules", "name", "defaults"}:
        run_policy_file(config, tmp_path)
    else:
        unknown = keys - POLICY_FIELDS
        assert not unknown, f"{block.id}: {sorted(unknown)} are neither policy fields nor a LightningCLI config's"
        to_policy("regional", **config)  # a section, as `compile=regional` plus the section would give it


def run_policy_file(config: Dict, tmp_path: Path) -> None:
    """A policy file as a user adds one: into conf/compile/, composed by Hydra; and in a project of one's own,
    read from its path. The same policy both ways, validated, applied, one step."""
    name = config.get("name", "doc_example")
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    assert not (conf / "compile" / f"{name}.yaml").exists(), f"the example's name {name!r} is a bundled policy's"
    (conf / "compile" / f"{name}.yaml").write_text(yaml.safe_dump(config))
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"compile={name}"])
    policy = to_policy(OmegaConf.to_container(cfg.compile, resolve=True), backend="eager")
    assert policy.name == name
    own = tmp_path / "configs" / "compile" / f"{name}.yaml"
    own.parent.mkdir(parents=True)
    own.write_text(yaml.safe_dump(config))
    assert to_policy(str(own), backend="eager") == policy, "a file read by path differs from Hydra's composition"
    if not policy.rules:
        return
    from compile_trainer_recipes.gpt import LanguageModel

    model = LanguageModel(TINY_GPT)
    applied = apply_policy(model, policy)
    try:
        tokens = torch.randint(0, 256, (2, TINY_GPT["block_size"] + 1))
        model.training_step((tokens[:, :-1], tokens[:, 1:]), 0).backward()
        assert all(item.calls > 0 for item in applied.compiled), "every region ran"
    finally:
        applied.remove()
        torch._dynamo.reset()


def run_lightning_cli_config(block: Block, config: Dict, tmp_path: Path) -> None:
    """A LightningCLI config, built as `python my_cli.py fit --config config.yaml` builds it (without fitting)."""
    from lightning.pytorch.cli import LightningCLI

    from compile_trainer_recipes.data import StdlibTextDataModule
    from compile_trainer_recipes.gpt import LanguageModel

    path = tmp_path / "config.yaml"
    path.write_text(block.text)
    argv, sys.argv = sys.argv, ["my_cli.py"]  # LightningCLI reads `args`; pytest's argv would only make it warn
    try:
        args = ["--config", str(path), "--model.model", json.dumps(TINY_GPT), f"--trainer.default_root_dir={tmp_path}"]
        cli = LightningCLI(LanguageModel, StdlibTextDataModule, run=False, args=args)
    finally:
        sys.argv = argv
    declared = [
        c for c in config.get("trainer", {}).get("callbacks", []) if c["class_path"].endswith("CompileCallback")
    ]
    built = [c for c in cli.trainer.callbacks if isinstance(c, CompileCallback)]
    assert len(built) == len(declared) > 0, f"{block.id}: the config's CompileCallback was not built"
    for entry, callback in zip(declared, built):
        for field, value in (entry.get("dict_kwargs") or {}).items():
            assert getattr(callback.policy, field) == value, f"{block.id}: override {field}={value!r} not applied"


# ------------------------------------------------------------------------------------------------------ bash


def commands(text: str) -> List[List[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped, split at `&&`."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1 :]
    return found


def run_command(block: Block, words: List[str]) -> None:
    if words[:2] == ["pip", "install"]:
        check_pip_install(words)
    elif words[:2] == ["python", "train.py"]:
        check_train_command(words[2:])
    elif words[:1] == ["compile-trainer"] or words[:3] == ["python", "-m", "compile_trainer"]:
        check_cli_command(words[1:] if words[0] == "compile-trainer" else words[3:])
    elif words[:1] == ["python"] and len(words) > 1 and words[1].startswith("benchmarks/"):
        check_benchmark_command(words[1:])
    elif words[:3] == ["python", "-m", "pytest"]:  # this suite: CI runs the README's line (.ci/run), not this test
        assert (ROOT / ".ci" / "run").is_file()
    elif words[:1] == ["wandb"]:  # needs a W&B server or account: not run; what it names must exist
        assert all((ROOT / w).exists() for w in words[2:] if w.endswith(".yaml")), words
    else:
        raise AssertionError(f"{block.id}: no handler for the command {' '.join(words)!r}; mark the block")


def check_pip_install(words: List[str]) -> None:
    """Set-up is not run here (CI runs the README's test line); the extras it names must exist."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for word in words[2:]:
        match = re.fullmatch(r"(?:\.|compile_trainer)\[(?P<extras>[^\]]+)\]", word)
        if match:
            assert set(match["extras"].split(",")) <= extras, f"unknown extra in {word!r}; extras: {sorted(extras)}"


class TrainConfigs:
    """Hydra composition of the repository's conf/, as ``train.py`` composes it."""

    def __init__(self):
        register_configs()
        self.parser = OverridesParser.create()

    def runs(self, arguments: List[str]) -> List[List[str]]:
        """The runs a command line makes: one, or every combination of a multirun's sweeps (the command line's
        own and those of a `+sweep=` config, whose lists the command line's replace)."""
        multirun = bool({"-m", "--multirun"} & set(arguments))
        overrides = [a for a in arguments if a not in ("-m", "--multirun")]
        parsed = self.parser.parse_overrides(overrides)
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        sweeps = {o.get_key_element(): list(o.sweep_string_iterator()) for o in parsed if o.is_sweep_override()}
        assert multirun or not sweeps, f"sweep values without -m: {overrides}"
        if multirun:
            first = [f"{key}={values[0]}" for key, values in sweeps.items()]
            cfg = compose("config", overrides=[*fixed, *first], return_hydra_config=True)
            params = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False).get("params") or {}
            for override in self.parser.parse_overrides([f"{k}={v}" for k, v in params.items()]):
                sweeps.setdefault(override.get_key_element(), list(override.sweep_string_iterator()))
        keys = list(sweeps)
        return [[*fixed, *(f"{k}={v}" for k, v in zip(keys, values))] for values in itertools.product(*sweeps.values())]

    def check(self, overrides: List[str]) -> None:
        """What `train.py` checks before training: the config resolves, the policy and telemetry settings are
        valid (the callback is built), the sweep settings too, and the trainer's keys are Trainer arguments."""
        import lightning.pytorch as pl

        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        cfg.hydra.runtime.output_dir = "outputs/doc-example"  # what Hydra sets when a job starts
        HydraConfig.instance().set_config(cfg)
        try:
            for key in set(cfg) - {"hydra"}:  # every interpolation of the job's config resolves
                OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
        finally:
            HydraConfig.instance().cfg = None  # no job runs: nothing after this test may see one
        build_callback(cfg)
        to_sweep_settings(cfg.sweep)
        trainer_arguments = set(inspect.signature(pl.Trainer).parameters)
        unknown = set(cfg.trainer) - trainer_arguments - {"_target_"}
        assert not unknown, f"{overrides}: not Trainer arguments: {sorted(unknown)}"


def check_train_command(arguments: List[str]) -> None:
    configs = TrainConfigs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for overrides in configs.runs(arguments):
            configs.check(overrides)


def check_cli_command(arguments: List[str]) -> None:
    args = build_parser().parse_args(arguments)  # exits (SystemExit) on anything the parser refuses
    if args.command == "explain" and args.overrides:
        check_train_command(args.overrides)


def check_benchmark_command(words: List[str]) -> None:
    script = ROOT / words[0]
    assert script.is_file(), f"no benchmark script {words[0]}"
    source = script.read_text()
    if "from benchmarks import common" in source:  # the harness declares --out, --smoke and the shared flags
        source += (ROOT / "benchmarks" / "common.py").read_text()
    for option in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
        assert f'"{option}"' in source, f"{words[0]} declares no option {option}"


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs(block: Block, tmp_path, monkeypatch, request):
    if block.illustration is not None:
        assert block.illustration, f"{block.id}: an illustration marker must say why the block is not run"
        return
    monkeypatch.chdir(tmp_path)  # what an example writes (logs, checkpoints) stays out of the repository
    if block.lang == "python" and block.page.name == "README.md":
        run_python_as_a_user(block, request.getfixturevalue("installed_package"), tmp_path)
    elif block.lang == "python":
        run_python(block)
    elif block.lang == "yaml":
        run_yaml(block, tmp_path)
    elif block.lang == "bash":
        found = commands(block.text)
        assert found, f"{block.id}: an empty bash block"
        for words in found:
            run_command(block, words)
    else:
        raise AssertionError(
            f"{block.id}: no handler for a {block.lang or 'plain'!r} block; mark it with "
            "<!-- illustration: <why it is not run> --> on the line before its fence"
        )


def test_the_readme_has_one_ci_test_command():
    """.ci/run runs the first README line matching `^pip install .*pytest` verbatim: there is exactly one."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"^pip install .*pytest", line)]
    assert len(lines) == 1 and "python -m pytest" in lines[0], lines
    # the README's suite leaves three tiers out (tests/conftest.py: TIERS); CI runs them after it (vision: in
    # .ci/torch_versions.sh's torch 2.14.1 environment, which has torchvision)
    assert lines[0].endswith('-m "not benchmarks and not distributed and not vision"'), lines
    assert 'python -m pytest -q -n 2 -m "benchmarks or distributed"' in (ROOT / ".ci" / "run").read_text()
    assert "-m vision" in (ROOT / ".ci" / "torch_versions.sh").read_text()


def test_the_readme_lists_every_bundled_policy():
    listed = re.findall(r"^\| `([a-z_]+)` \|", (ROOT / "README.md").read_text(), flags=re.M)
    assert listed and sorted(listed) == bundled_policy_names()


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to a missing file {target}"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
            assert anchor in {github_anchor(h) for h in headings}, f"{page.name}: no heading for {target}"
