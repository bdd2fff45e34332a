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


def test_distributed_benchmark_smoke_runs_ddp_and_fsdp2_on_1_and_2_processes(tmp_path):
    out = tmp_path / "distributed.json"
    script = ["benchmarks/distributed.py", "--smoke", "--policies", "regional", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYDRA_AND_WANDB, *script], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "distributed" and data["notes"] and "distributed.py --smoke" in data["meta"]["command"]
    rows = {(row["strategy"], row["gpus"]): row for row in data["rows"]}
    assert list(rows) == [("ddp", 1), ("ddp", 2), ("fsdp2", 1), ("fsdp2", 2)]
    for (strategy, gpus), row in rows.items():
        assert row["error"] is None, (strategy, gpus, row["error"])
        assert row["samples_per_s"] > 0 and 0 < row["first_step_s_min"] <= row["first_step_s_max"]
        assert len(row["recompiles_by_rank"]) == gpus and row["divergent_ranks"] == []
        assert row["scaling_vs_1"] > 0 and row["first_step_vs_1"] > 0
        if gpus == 1:
            assert row["scaling_vs_1"] == 1.0
    assert "scaling_vs_1" in result.stdout  # the table
