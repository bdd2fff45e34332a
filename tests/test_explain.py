"""``compile-trainer explain``: graph breaks with reason, location and module; exit codes for CI."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from compile_trainer.cli.main import EXIT_BAD_INPUT, EXIT_BREAKS, EXIT_OK, main
from tests import telemetry_models as models
from tests.test_train_script import TINY

ROOT = Path(__file__).resolve().parents[1]
EAGER = ["compile=regional", "compile.backend=eager"]


def test_broken_module_fails_with_the_break_located_and_clean_module_passes(capsys):
    code = main(["explain", "--module", "tests.telemetry_models:BrokenRegression", *EAGER, "--fail-on-break"])
    out = capsys.readouterr().out
    assert code == EXIT_BREAKS
    assert f"{models.__file__}:{models.line_of('graph break: item')} in forward" in out
    assert "reason: Unsupported Tensor.item()" in out and "capture_scalar_outputs" in out
    assert "module net.blocks.0 and 1 more (ItemBreakBlock)" in out
    assert "1 graph break, 0 declared by eager rules" in out

    assert main(["explain", "--module", "tests.telemetry_models:BrokenRegression", *EAGER]) == EXIT_OK
    capsys.readouterr()
    assert main(["explain", "--module", "tests.telemetry_models:clean_regression", *EAGER, "--fail-on-break"]) == 0
    out = capsys.readouterr().out
    assert "graph breaks: 0" in out
    assert re.search(r"net.blocks  2 +1 +0 +0 +1 ", out), "one graph for both blocks"


def test_break_declared_by_an_eager_rule_does_not_fail(capsys):
    rules = "compile.rules=[{name: net}, {name: net.blocks.1, action: eager}]"
    code = main(["explain", "--module", "tests.telemetry_models:clean_regression", "compile.backend=eager", rules,
                 "--fail-on-break"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert f"{models.__file__}:{models.line_of('calls each block')} in forward [declared: eager rule]" in out
    assert "eager_fallback of net" in out and "inside a loop" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--module", "tests.telemetry_models:Nope"], "cannot be imported"),
        (["--module", "tests.telemetry_models"], "give it as 'package.module:Name'"),
        (["--module", "tests.telemetry_models:items_in_batch"], "cannot be made without arguments"),
        (["--module", "tests.telemetry_models:Net"], "gave a Net, not a LightningModule"),
        (["compile=fastest"], "Could not find 'compile/fastest'"),
        (["compile.mode=turbo"], "invalid mode 'turbo'"),
    ],
)
def test_bad_input_exits_with_2_and_says_what_is_wrong(args, message, capsys):
    assert main(["explain", *args]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_python_m_compile_trainer_explains_a_recipe_config():
    command = [sys.executable, "-m", "compile_trainer", "explain", *EAGER, *TINY, "--fail-on-break"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one training step of LanguageModel" in result.stdout
    assert re.search(r"model\.blocks\s+2\s+1\s+0\s+0\s+1\s", result.stdout), result.stdout
    assert "0 graph breaks, 0 declared by eager rules" in result.stdout
