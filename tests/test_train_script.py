"""``train.py`` end to end, as a user runs it: real Hydra, real Lightning, real W&B offline runs."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

from compile_trainer.runs.wandb_offline import read_offline_run

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "recipe.module.model.n_layer=2",
    "recipe.module.model.n_embd=32",
    "recipe.module.model.block_size=32",
    "recipe.data.max_bytes=300000",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
]


def run_train(
    tmp_path: Path, *overrides: str, env: Optional[Dict[str, str]] = None, small: Sequence[str] = TINY
) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", *small, *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


# The quick start's 4 blocks, narrower, on shorter rows: as in the README, under 10% of the weights outside them.
QUICK_START_SMALLER = [
    "recipe.module.model.n_embd=64",
    "recipe.module.model.block_size=32",
    "recipe.data.batch_size=4",
    *(setting for setting in TINY if not setting.startswith("recipe.module.model.")),
]
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
FLOP_RATE = re.compile(r"[TGM]FLOP/s")
QUICK_START_OUTPUT = "<!-- illustration: console output of the quick start"


def line_pattern(line: str) -> re.Pattern:
    """A printed line as the README shows it, with any numbers, any column widths, and, where it ends in ``...``
    (abridged), anything after it."""
    abridged = line.rstrip().endswith("...")
    words = line.rstrip().removesuffix("...").split()

    def word_pattern(word: str) -> str:
        if set(word) == {"-"}:
            return "-+"  # a table's rule, as wide as its column
        if FLOP_RATE.fullmatch(word):
            return FLOP_RATE.pattern  # in the unit that suits the model
        return r"[\d,.]+".join(re.escape(part) for part in NUMBER.split(word))

    return re.compile(r"^\s*" + r"\s+".join(map(word_pattern, words)) + (r".*$" if abridged else r"\s*$"), re.M)


def quick_start_output_in_the_readme() -> list:
    """The lines of the README's illustration of the quick start's output, but the ``...`` that abridge it."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(QUICK_START_OUTPUT) :].split("```")[1]
    return [line for line in block.splitlines()[1:] if line.strip() and line.strip() != "..."]


def test_train_regional_with_inductor_records_loss_in_wandb_and_prints_what_the_readme_shows(tmp_path):
    """The README's quick start (``compile=regional``, long enough for the eager reference steps) on a smaller GPT:
    every line the README shows of its output is printed, but for numbers and column widths."""
    fresh_machine = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # torch's caches empty
    overrides = ["compile=regional", "trainer.max_steps=20", "trainer.val_check_interval=10"]
    result = run_train(tmp_path, *overrides, env=fresh_machine, small=QUICK_START_SMALLER)
    output = result.stdout + result.stderr
    assert "compile policy 'regional'" in output
    missing = [line for line in quick_start_output_in_the_readme() if not line_pattern(line).search(output)]
    assert not missing, f"README lines that the quick start does not print: {missing}\n{output[-4000:]}"
    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    losses = run.series("train/loss")
    assert len(losses) == 20 and all(0 < loss < 10 for loss in losses)
    assert run.series("val/loss"), "validation loss is reported"
    assert run.config["config"]["compile"]["name"] == "regional"
    plan = {row["module"]: row for row in run.config["compile_plan"]}
    assert plan["model.blocks.0"]["action"] == "regional block" and plan["model.blocks.0"]["shares_graph_with"] == 4
    assert "backend=inductor" in plan["model.blocks.0"]["settings"]


def test_train_with_csv_logger_and_trainer_overrides(tmp_path):
    run_train(
        tmp_path,
        "compile=full",
        "compile.backend=aot_eager",
        "logger=csv",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.gradient_clip_val=1.0",
        "save_checkpoint=true",
    )
    metrics = next(tmp_path.glob("csv/*/metrics.csv")).read_text()
    assert "train/loss" in metrics.splitlines()[0]
    assert "compile_plan" in next(tmp_path.glob("csv/*/hparams.yaml")).read_text()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize(
    "override, message",
    [
        ("compile=fastest", "compile=fastest: no policy of the group"),
        ("compile.mode=turbo", "invalid mode 'turbo'. Valid modes"),
        ("+compile.rules.0.class_name=Blok", "matches no module.*Block"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, override, message):
    command = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", *TINY, override]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr[-3000:]
    assert "Epoch 0" not in result.stdout + result.stderr


def test_misspelt_keys_fail_before_composition_naming_the_near_match_and_the_valid_keys(tmp_path):
    (tmp_path / "conf" / "compile").mkdir(parents=True)
    policy = "defaults: [schema, _self_]\nrules: [{name: model, action: full}]\nshapes: {pad: {bukets: [64]}}\n"
    (tmp_path / "conf" / "compile" / "mine.yaml").write_text(policy)
    overrides = [f"hydra.run.dir={tmp_path}", "compile=mine", "compile.bakend=eager"]
    command = [sys.executable, "train.py", "--config-dir", str(tmp_path / "conf"), *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()[-2:]
    assert lines[0].startswith(
        f"{tmp_path / 'conf' / 'compile' / 'mine.yaml'}: unknown key 'compile.shapes.pad.bukets' "
        "(did you mean 'buckets'?); valid keys of compile.shapes.pad: dim, buckets, multiple_of"
    ), result.stderr
    assert lines[1].startswith("unknown key 'compile.bakend' (did you mean 'backend'?); valid keys of compile: backend")
