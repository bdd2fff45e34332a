"""A project of its own, in the lightning-hydra-template's layout, uses the package as a user installs it: the
bundled policies composed from its search path (``pkg://compile_trainer.conf``), its own policy file in its own
``configs/compile/``, the callback from ``configs/callbacks/``; and policies given by path, mapping or DictConfig."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from compile_trainer import CompileCallback, PolicyError, to_policy

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import torch
from lightning.pytorch import LightningModule
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TinyRegression(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = Net()

    def training_step(self, batch, batch_index):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""

TRAIN = """
import json

import hydra
import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from compile_trainer.compiling.plan_table import plan_rows

from model import TinyRegression


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg):
    callbacks = [instantiate(callback) for callback in cfg.callbacks.values()]
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
    trainer = Trainer(
        accelerator="cpu", max_steps=cfg.max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(TinyRegression(), data)
    (compiled,) = [callback for callback in callbacks if hasattr(callback, "applied")]
    rows = [[row["module"], row["action"], row["settings"]] for row in plan_rows(compiled.applied)]
    compile_s = compiled.summary()["compile_time_s"]
    result = {"policy": compiled.policy.name, "steps": trainer.global_step, "plan": rows, "compile_s": compile_s}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
"""

# configs/: as the lightning-hydra-template lays them out, with the bundled compile group on the search path.
CONFIGS = {
    "train.yaml": "defaults:\n  - compile: regional\n  - callbacks: compile\n  - _self_\n\nmax_steps: 3\n\n"
    "hydra:\n  searchpath:\n    - pkg://compile_trainer.conf\n",
    "callbacks/compile.yaml": "compile:\n  _target_: compile_trainer.CompileCallback\n  policy: ${compile}\n",
    "compile/my_policy.yaml": "defaults: [schema, _self_]\nname: my_policy\nrules: [{name: model.head, action: full}]",
}


def installed_package(site: Path) -> None:
    """The package as its wheel installs it (pyproject.toml: ``conf/`` ships as ``compile_trainer.conf``),
    without building one: nothing of this checkout but the package is importable from ``site``."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"compile_trainer.conf": "conf"}
    assert "compile_trainer.conf" in setuptools["packages"]
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "compile_trainer", site / "compile_trainer", ignore=ignore)
    shutil.copytree(ROOT / "conf", site / "compile_trainer" / "conf", ignore=ignore)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("my_project")
    installed_package(root / "site")
    for name, text in {**{f"configs/{k}": v for k, v in CONFIGS.items()}, "src/train.py": TRAIN}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "src" / "model.py").write_text(MODEL)
    return root


def run_project(project: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(project / "site")}
    command = [sys.executable, "src/train.py", f"hydra.run.dir={project / 'outputs'}", *overrides]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)


def result_of(process: subprocess.CompletedProcess) -> dict:
    assert process.returncode == 0, process.stderr[-3000:]
    (line,) = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_a_bundled_policy_composed_from_the_search_path_trains(project):
    process = run_project(project, "compile=regional", "compile.backend=eager")
    result = result_of(process)
    assert "compile_trainer" not in {p.name for p in project.iterdir()}, "the project holds no copy of the package"
    assert result["policy"] == "regional" and result["steps"] == 3
    plan = {module: (action, settings) for module, action, settings in result["plan"]}
    assert [plan[f"model.blocks.{i}"][0] for i in range(3)] == ["regional block"] * 3
    assert all("backend=eager" in settings for _, settings in plan.values())
    assert "is not available" not in process.stderr, "Hydra reads pkg://compile_trainer.conf as a package"


COMPOSE_EACH = """
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from compile_trainer import to_policy

names = {}
with initialize_config_dir(str(Path("configs").resolve()), version_base="1.3"):
    for choice in sys.argv[1:]:
        policy = to_policy(OmegaConf.to_container(compose("train", overrides=[f"compile={choice}"]).compile))
        names[choice] = policy.name
print("RESULT " + json.dumps(names))
"""


def test_every_bundled_policy_composes_into_the_projects_config(project):
    """Each bundled policy composes from the search path into a config that has none of this repository's groups
    (no recipe, no trainer): a bundled file that chose one of them would fail here."""
    bundled = sorted(path.stem for path in (ROOT / "conf" / "compile").glob("*.yaml") if path.stem != "schema")
    write(project / "src" / "compose_each.py", COMPOSE_EACH)
    env = {**os.environ, "PYTHONPATH": str(project / "site")}
    process = subprocess.run(
        [sys.executable, "src/compose_each.py", *bundled, "my_policy"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result_of(process) == {name: name for name in [*bundled, "my_policy"]}


def test_the_projects_own_policy_file_beside_the_bundled_ones_trains(project):
    process = run_project(project, "compile=my_policy", "compile.backend=eager")  # a key the file does not set
    result = result_of(process)
    assert result["policy"] == "my_policy" and result["steps"] == 3
    assert result["plan"] == [["model.head", "full", "backend=eager"]], "its one rule, nothing bundled"
    assert result["compile_s"] > 0, "the head was compiled"
    assert "compile policy 'my_policy'" in process.stderr + process.stdout, "the printed plan"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


HEAD_RULE = "rules:\n  - {name: model.head, action: full}\n"


def test_a_policy_file_by_its_path_with_or_without_the_defaults_line(tmp_path, monkeypatch):
    with_line = write(tmp_path / "configs" / "compile" / "mine.yaml", f"defaults: [schema, _self_]\n{HEAD_RULE}")
    without = write(tmp_path / "plain.yml", f"backend: eager\n{HEAD_RULE}")
    monkeypatch.chdir(tmp_path)
    for spec in (str(with_line), "configs/compile/mine.yaml", with_line, "./plain.yml", without):
        policy = to_policy(spec)
        assert [(r.name, r.action) for r in policy.rules] == [("model.head", "full")], spec
        assert policy.name == Path(spec).stem, "a file without a name is named by its stem"
    assert to_policy(without).backend == "eager" and to_policy(with_line).backend == "inductor"
    # its defaults list builds on policies beside it, then on bundled ones, as Hydra's compile group would
    write(tmp_path / "configs" / "compile" / "on_mine.yaml", "defaults: [schema, mine, _self_]\nbackend: aot_eager\n")
    write(tmp_path / "configs" / "compile" / "on_dynamic.yaml", "defaults: [schema, dynamic, _self_]\nname: mine\n")
    on_mine, on_dynamic = to_policy("configs/compile/on_mine.yaml"), to_policy("configs/compile/on_dynamic.yaml")
    assert on_mine.rules == to_policy(with_line).rules and on_mine.backend == "aot_eager"
    assert on_dynamic.shapes == to_policy("dynamic").shapes and on_dynamic.name == "mine"
    # the file loaded as a mapping (OmegaConf.load), defaults line and all
    assert to_policy(OmegaConf.load(with_line)).rules == to_policy(with_line).rules
    assert to_policy(OmegaConf.load(tmp_path / "configs" / "compile" / "on_dynamic.yaml")).shapes == on_dynamic.shapes


def test_a_name_is_a_bundled_policy_and_an_unknown_one_says_what_was_looked_for(tmp_path, monkeypatch):
    write(tmp_path / "configs" / "compile" / "my_policy.yaml", f"defaults: [schema, _self_]\n{HEAD_RULE}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicyError) as error:
        CompileCallback("my_policy")
    message = str(error.value)
    assert "a name is a bundled policy (buckets, " in message and "schema" not in message
    assert "given by its path (ending in .yaml), such as 'configs/compile/my_policy.yaml'" in message
    with pytest.raises(PolicyError, match=r"unknown compile policy 'regionl' \(did you mean 'regional'\?\)"):
        CompileCallback("regionl")
    with pytest.raises(PolicyError, match=r"'schema': the schema that policy files build on .*, not a policy"):
        CompileCallback("schema")
    looked = str(tmp_path / "configs" / "compile" / "my_polcy.yaml")
    with pytest.raises(PolicyError, match=rf"looked for '{looked}' \(did you mean 'my_policy.yaml'\?\)"):
        CompileCallback("configs/compile/my_polcy.yaml")
    with pytest.raises(PolicyError, match=r"defaults list names 'dynamc' \(did you mean 'dynamic'\?\)"):
        to_policy(write(tmp_path / "on_typo.yaml", "defaults: [schema, dynamc, _self_]\n"))


def test_a_policy_from_a_hydra_callbacks_config_by_name_mapping_path_or_composed_group(tmp_path, monkeypatch):
    """``configs/callbacks/compile.yaml`` with ``_target_: compile_trainer.CompileCallback``, composed by Hydra and
    instantiated as a lightning-hydra-template project does; ``compile=schema`` there names no 'custom' policy."""
    from compile_trainer.runs.hydra_configs import register_group_schemas

    register_group_schemas()
    configs = tmp_path / "configs"
    write(configs / "train.yaml", "defaults:\n  - compile: my_policy\n  - callbacks: compile\n  - _self_\n")
    write(configs / "compile" / "my_policy.yaml", f"defaults: [schema, _self_]\nname: my_policy\n{HEAD_RULE}")
    target = "compile:\n  _target_: compile_trainer.CompileCallback\n  backend: eager\n"
    write(configs / "callbacks" / "compile.yaml", target + "  policy: ${compile}\n")
    write(configs / "callbacks" / "by_name.yaml", target + "  policy: full\n")
    write(configs / "callbacks" / "by_path.yaml", target + "  policy: configs/compile/my_policy.yaml\n")
    write(configs / "callbacks" / "mapping.yaml", target + "  policy:\n    rules: [{name: model.head, action: full}]\n")
    monkeypatch.chdir(tmp_path)  # a path in a config is relative to the working directory (Hydra keeps it)

    def callback(*overrides: str) -> CompileCallback:
        with initialize_config_dir(str(configs), version_base="1.3"):
            return instantiate(compose("train", overrides=list(overrides)).callbacks.compile)

    composed, by_path, mapping = callback(), callback("callbacks=by_path"), callback("callbacks=mapping")
    assert composed.policy.name == by_path.policy.name == "my_policy" and mapping.policy.name == "custom"
    assert composed.policy.rules == by_path.policy.rules == mapping.policy.rules == to_policy(HEAD_RULE_POLICY).rules
    assert {composed.policy.backend, by_path.policy.backend, mapping.policy.backend} == {"eager"}
    assert callback("callbacks=by_name").policy == to_policy("full", backend="eager")
    assert callback("compile.backend=aot_eager", "~callbacks.compile.backend").policy.backend == "aot_eager"
    with pytest.raises(
        Exception, match="with compile=schema: that selects the schema that policy files build on"
    ) as error:
        callback("compile=schema")
    assert "'custom'" not in str(error.value) and "unnamed compile policy" in str(error.value)


HEAD_RULE_POLICY = {"rules": [{"name": "model.head", "action": "full"}]}
