"""Input errors fit on a screen and name the fix: an unknown backend or policy, ``schema`` taken for a policy, a
misspelt policy name; ``train.py`` reports them before the run starts, without a traceback, with status 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile_trainer import CompileCallback, PolicyError
from compile_trainer.compiling.runtime_checks import TORCH_INTERNAL_BACKEND
from compile_trainer.runs.hydra_configs import INPUT_ERROR_STATUS, register_configs, unknown_group_choices

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register_configs()
TORCH_TEST_BACKENDS = ("relu_compile_error_TESTING_ONLY", "dynamo_minifier_backend", "eager_debug")


def test_an_unknown_backend_lists_the_valid_ones_without_torchs_test_backends():
    registered = torch.compiler.list_backends(exclude_tags=())
    assert set(TORCH_TEST_BACKENDS) <= set(registered), "torch registers them: the list below leaves them out"
    with pytest.raises(PolicyError) as error:
        CompileCallback("regional", backend="xyzzy")  # near no name: other tests of this process register backends
    message = str(error.value)
    assert message.startswith("compile policy 'regional': unknown backend 'xyzzy'. Valid backends: ")
    valid = message.split("Valid backends: ")[1].rstrip(".").split(", ")
    assert {"eager", "aot_eager", "inductor"} <= set(valid) and set(valid) < set(registered)
    assert not [name for name in valid if TORCH_INTERNAL_BACKEND.search(name)]
    assert not set(TORCH_TEST_BACKENDS) & set(valid)
    with pytest.raises(PolicyError, match=r"rule 0 .*unknown backend 'indcutor' \(did you mean 'inductor'\?\)"):
        CompileCallback({"rules": [{"name": "*", "backend": "indcutor"}]})
    assert CompileCallback("full", backend="eager_debug").policy.backend == "eager_debug", "left out, not refused"


def test_group_choices_are_checked_before_composing_with_the_schemas_left_out(tmp_path):
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / "mine.yaml").write_text("defaults: [schema, _self_]\nrules: [{name: model}]\n")
    overrides = ["compile=regional,regionl,mine,schema", "trainer=gpux", "recipe=gpt_tiny", "seed=1", "~logger"]
    problems = unknown_group_choices(overrides, [tmp_path, CONF], "config")
    assert [p.split(";")[0] for p in problems] == [
        "compile=regionl: no policy of the group (did you mean 'regional'?)",
        "compile=schema: the schema that the compile files build on, not a policy of the group",
        "trainer=gpux: no config of the group (did you mean 'gpu'?)",
    ]
    policies = problems[0].split("; choices: ")[1].split(", ")
    assert "mine" in policies and "regional" in policies and "schema" not in policies
    trainers = sorted(path.stem for path in (CONF / "trainer").glob("*.yaml") if path.stem != "schema")
    assert problems[2].endswith("; choices: " + ", ".join(trainers)) and "gpu_ddp" in trainers
    assert unknown_group_choices([f"hydra.searchpath=[file://{tmp_path}]", "compile=mine"], [CONF], "config") == []


def run_train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", "logger=csv", "trainer.max_steps=1", *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_one_screen(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == INPUT_ERROR_STATUS == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "Epoch" not in output
    assert len(output.strip().splitlines()) <= 3, output
    return output


def test_train_py_refuses_an_unknown_backend_before_the_run_without_a_result_file(tmp_path):
    output = assert_one_screen(run_train(tmp_path, "compile.backend=notabackend"))
    assert "PolicyError: compile policy 'regional': unknown backend 'notabackend'. Valid backends: " in output
    assert "eager, " in output and "TESTING" not in output and "minifier" not in output
    assert not (tmp_path / "result.json").exists(), "an input error is no failed run"


@pytest.mark.parametrize("choice", ["nonexistent", "schema"])
def test_train_py_lists_the_policies_for_an_unknown_one_and_never_offers_schema(tmp_path, choice):
    output = assert_one_screen(run_train(tmp_path, f"compile={choice}"))
    assert f"compile={choice}: " in output and "'custom'" not in output
    policies = output.split("; choices: ")[1].strip().split(", ")
    assert "regional" in policies and "schema" not in policies


BAD_COMMAND_LINE = """
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as done:
    print(done.code, sorted(name for name in ("lightning", "wandb") if name in sys.modules))
"""


@pytest.mark.parametrize("override", ["compile=regionl", "compile.bakend=eager"])
def test_a_bad_command_line_is_reported_before_lightning_is_imported(override):
    """Lightning takes seconds to import: a typo's message comes first (the trainer's schema, which needs Lightning,
    is made once the command line is checked, or where an override names a trainer key)."""
    result = subprocess.run(
        [sys.executable, "-c", BAD_COMMAND_LINE, override], cwd=ROOT, capture_output=True, text=True
    )
    assert result.stdout.split() == [str(INPUT_ERROR_STATUS), "[]"], result.stdout + result.stderr[-2000:]
    assert "did you mean" in result.stderr
