"""``train.py`` on several processes, as a user picks them: ``trainer=gpu_ddp`` under every bundled policy (one
Hydra multirun: Lightning starts rank 1 at the first run's fit, and both ranks then train the runs in turn in one
process group) with the losses of eager DDP, and ``trainer=gpu_fsdp2`` once, each on 2 CPU processes over gloo;
the link plan, the world size and the per-rank figures in ``result.json``, the CSV log and the W&B run; the settings
a strategy cannot run refused before any rank starts."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from compile_trainer.runs.wandb_offline import read_offline_run
from compile_trainer_recipes.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
# gpt_tiny's, smaller; 64 positions: dynamic_full pads lengths to a multiple of 64
MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)
TINY = [f"recipe.module.model.{key}={value}" for key, value in MODEL.items() if key != "vocab_size"]
TWO_CPU_RANKS = [
    "trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.devices=2", "trainer.max_steps=4",
    "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "recipe=gpt_tiny", *TINY,
    "recipe.data.max_bytes=200000", "recipe.data.batch_size=4",
]  # fmt: skip
POLICIES = sorted(path.stem for path in (ROOT / "conf" / "compile").glob("*.yaml") if path.stem != "none")
TIMEOUT = 1800


def run_train(*overrides: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "train.py", *overrides]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def csv_losses(run_dir: Path) -> List[float]:
    with next(run_dir.glob("csv/*/metrics.csv")).open() as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


def with_test_backends(conf: Path) -> List[str]:
    """Each bundled policy under a name of its own in ``conf`` (a config directory of the test), with the eager
    backend (aot_eager for nested regions, which need an AOT backend): the choices of the sweep."""
    (conf / "compile").mkdir(parents=True)
    for policy in ["none", *POLICIES]:
        backend = "aot_eager" if policy == "regional_nested" else "eager"
        (conf / "compile" / f"{policy}_test.yaml").write_text(f"defaults: [{policy}, _self_]\nbackend: {backend}\n")
    return [f"{policy}_test" for policy in ["none", *POLICIES]]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Dict[str, dict]:
    """Eager DDP (``none``) and every bundled policy under ``trainer=gpu_ddp``, in one multirun, by policy: the result
    file, the losses and the CSV log's columns; ``output``: every rank's output."""
    sweep, conf = tmp_path_factory.mktemp("ddp_sweep"), tmp_path_factory.mktemp("conf")
    policies = ",".join(with_test_backends(conf))
    done = run_train(
        "-m", f"--config-dir={conf}", f"hydra.sweep.dir={sweep}", "trainer=gpu_ddp", *TWO_CPU_RANKS, "logger=csv",
        f"compile={policies}",
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    runs = {}
    for result_file in sweep.glob("*/result.json"):
        result = json.loads(result_file.read_text())
        header = next(result_file.parent.glob("csv/*/metrics.csv")).read_text().splitlines()[0]
        runs[result["policy"]] = result | {"losses": csv_losses(result_file.parent), "columns": header.split(",")}
    return runs | {"output": done.stdout + done.stderr}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_under_gpu_ddp_like_eager_ddp(ddp_runs, policy):
    eager, run = ddp_runs["none"], ddp_runs[policy]
    assert run["status"] == "ok" and run["world_size"] == 2 and run["strategy"] == "ddp"
    assert len(run["losses"]) == 4 and run["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    ranks = run["summary"]["ranks"]
    assert ranks["ranks"] == 2 and ranks["divergent_recompile_ranks"] == []
    assert len(ranks["first_step_time_s_by_rank"]) == 2 and all(t > 0 for t in ranks["first_step_time_s_by_rank"])
    assert {"ranks/first_step_time_s/rank0", "ranks/first_step_time_s/rank1", "link/bytes_per_step"} <= set(
        run["columns"]
    )
    # the link plan: DDP all-reduces every gradient in fp32, 4 bytes a parameter, measured on the gloo link
    link = run["summary"]["link"]
    assert link["strategy"] == "ddp" and link["bytes_per_step"] == 4 * GPT(GPTConfig(**MODEL)).num_params()
    assert link["link_time_s"] > 0 and link["probe"]["busbw_gbps_largest"]["all_reduce"] > 0


def test_the_link_plan_is_printed_once_a_run(ddp_runs):
    assert ddp_runs["output"].count("link: 2 ranks over gloo: all-reduce") == len(POLICIES) + 1
    assert ddp_runs["output"].count("  ddp (fp32 gradients, 25 MiB buckets): ") == len(POLICIES) + 1


def test_gpu_fsdp2_trains_like_eager_ddp_and_the_wandb_run_carries_the_ranks(ddp_runs, tmp_path):
    """The recipe's configure_model applies the policy and shards (FSDP2's defaults without bf16: no casting)."""
    done = run_train(f"hydra.run.dir={tmp_path}", "trainer=gpu_fsdp2", *TWO_CPU_RANKS, "compile=regional",
                     "compile.backend=eager")  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    output = done.stdout + done.stderr
    assert "regions compiled in configure_model before fully_shard" in output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["strategy"] == "fsdp2"
    assert not list(tmp_path.glob("result.rank*.json")), "no rank failed"
    link = result["summary"]["link"]
    params = GPT(GPTConfig(**MODEL)).num_params()
    # fp32 parameters gathered in forward and in backward (but the root and the last block), reduced in fp32
    assert link["bytes_by_collective"]["reduce_scatter"] == 4 * params
    assert 4 * params < link["bytes_by_collective"]["all_gather"] < 8 * params
    assert "fsdp2 (fp32 parameters, fp32 reduction, reshard after forward (not the last block))" in output
    assert any(s["setting"].startswith("MixedPrecisionPolicy(param_dtype=bfloat16") for s in link["faster"])
    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    assert run.config["world_size"] == 2
    assert run.series("train/loss") == pytest.approx(ddp_runs["none"]["losses"], rel=1e-4)
    assert len(run.series("ranks/first_step_time_s/rank1")) == 1 and run.series("link/bytes_per_step") == [
        link["bytes_per_step"]
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer=gpu_fsdp2", "compile.optimizer.compile=true"], "optimizer.compile=true cannot run under FSDP2"),
        (["trainer=gpu_ddp", "trainer.strategy=fsdp"], r"does not support FSDPStrategy \(FSDP1"),
    ],
)
def test_what_a_strategy_cannot_run_is_refused_before_any_rank_starts(tmp_path, overrides, message):
    done = run_train(f"hydra.run.dir={tmp_path}", *TWO_CPU_RANKS, *overrides, "logger=csv", timeout=300)
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr[-3000:]
    assert "Initializing distributed" not in done.stdout + done.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"
