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
