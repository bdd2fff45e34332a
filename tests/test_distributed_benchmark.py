"""The multi-GPU benchmark's CPU smoke mode (2 gloo processes, a tiny GPT), run as on the GPU image: hydra and
wandb unimportable (omegaconf is carried there)."""

import json
import subprocess
import sys

from tests.benchmark_smoke import ROOT

WITHOUT_HYDRA_AND_WANDB = (
    "import runpy, sys\n"
    "for name in ('hydra', 'wandb'):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_distributed_benchmark_smoke_runs_ddp_fsdp2_and_the_cache_on_1_and_2_processes(tmp_path):
    """The HF Llama path (its blocks sharded under FSDP2), one device against two, and the warm cache row."""
    out = tmp_path / "distributed.json"
    script = ["benchmarks/distributed.py", "--smoke", "--models", "llama", "--policies", "regional", "--out", str(out)]
    script += ["--experiments", "scaling,cache"]
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYDRA_AND_WANDB, *script], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "distributed" and data["notes"] and "distributed.py --smoke" in data["meta"]["command"]
    rows = {(row["experiment"], row["strategy"], row["gpus"]): row for row in data["rows"]}
    assert list(rows) == [("scaling", "-", 1), ("scaling", "ddp", 2), ("scaling", "fsdp2", 2), ("cache", "ddp", 2)]
    for key, row in rows.items():
        gpus = key[2]
        assert row["error"] is None, (key, row["error"])
        assert row["samples_per_s"] > 0 and all(s > 0 for s in row["first_step_s_by_rank"])
        assert len(row["first_step_s_by_rank"]) == len(row["recompiles_by_rank"]) == gpus
        assert len(row["step_ms_median_by_rank"]) == gpus and all(m > 0 for m in row["step_ms_median_by_rank"])
        assert row["divergent_ranks"] == [] and row["scaling_vs_1"] > 0 and row["first_step_vs_1"] > 0
    assert rows["scaling", "-", 1]["scaling_vs_1"] == 1.0
    cold, warm = rows["scaling", "ddp", 2]["cache"], rows["cache", "ddp", 2]["cache"]
    assert cold["status"] == "miss" and cold["precompiled_captures"] >= 1  # rank 0 wrote the bundle
    assert warm["status"] == "hit" and warm["precompiled_hits"] > 0  # a new machine was served from it
    assert "scaling_vs_1" in result.stdout  # the table
