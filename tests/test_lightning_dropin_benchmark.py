"""The drop-in benchmark's CPU smoke mode: a plain LightningModule with a Hugging Face batch (a dict of input_ids,
attention_mask and labels) gets tokens/s and FLOPs from the callback with no telemetry configuration."""

import json
import subprocess
import sys

from tests.benchmark_smoke import ROOT
from tests.test_distributed_benchmark import WITHOUT_HYDRA_AND_WANDB


def test_dropin_smoke_reports_the_summary_beside_the_benchmark_s_own_figures(tmp_path):
    out = tmp_path / "dropin.json"
    script = ["benchmarks/lightning_dropin.py", "--smoke", "--models", "llama", "--variants", "eager,regional"]
    script += ["--cache-policies", ""]  # train.py needs Hydra: its runs are the next test's
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYDRA_AND_WANDB, *script, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["eager", "regional"] and all(row["error"] is None for row in rows.values())
    assert rows["eager"]["units"] == "tokens" and rows["eager"]["per_s"] > 0
    regional = rows["regional"]
    assert regional["summary_per_s"] > 0 and regional["summary_vs_own"] > 0  # tokens/s with no configuration
    assert regional["summary_first_step_s"] > 0
    assert "summary_vs_own" in result.stdout  # the table


def test_dropin_cache_runs_train_py_twice_and_the_new_machine_traces_nothing(tmp_path):
    """train.py through Lightning's plugin, cold then on a new machine (empty Inductor and Triton caches, the
    bundle): every region call of the second run served by the precompiled layer, nothing traced or compiled."""
    out = tmp_path / "cache.json"
    script = ["benchmarks/lightning_dropin.py", "--smoke", "--models", "", "--cache-policies", "regional"]
    result = subprocess.run(
        [sys.executable, *script, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["regional cold", "regional new_machine", "full cold_no_cache"], rows
    assert all(row["error"] is None for row in rows.values()), rows
    cold, warm = rows["regional cold"], rows["regional new_machine"]
    assert cold["traced"] > 0 and cold["graphs"] > 0 and cold["failed_captures"] == 0
    assert warm["precompiled_served"] > 0 and (warm["traced"], warm["graphs"]) == (0, 0)
    assert (warm["eager_fallbacks"], warm["failed_captures"]) == (0, 0)
    assert rows["full cold_no_cache"]["precompiled_served"] is None  # no cache: no layer
    assert warm["vs_full_cold"] == warm["first_step_s"] / rows["full cold_no_cache"]["first_step_s"]
