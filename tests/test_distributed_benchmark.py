"""The multi-GPU benchmark's CPU smoke mode (2 gloo processes, a tiny GPT), run as on the GPU image: hydra and
wandb unimportable (omegaconf is carried there)."""

import json
import subprocess
import sys

import pytest

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


def test_the_gpu_timeline_splits_a_profiled_step_into_compute_nccl_overlap_and_idle(tmp_path):
    """Two steps of a Chrome trace: a GEMM 0-10 us, an all-reduce 5-15 us beside it, an elementwise kernel 20-25 us
    (a host event and a CPU op are not GPU time)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.distributed import gpu_timeline

    kernels = [("sm90_gemm", 0, 10), ("ncclDevKernel_AllReduce_Sum_f32", 5, 10), ("triton_poi_fused_add", 20, 5)]
    events = [{"cat": "kernel", "name": name, "ts": ts * 1000, "dur": dur * 1000} for name, ts, dur in kernels]
    events += [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30_000}, {"ph": "M", "name": "process_name"}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    # in ms a step (2 steps): span 25, compute 15, NCCL 10 of which 5 beside compute, idle 25 - 20 = 5
    assert gpu_timeline(trace, steps=2) == {"span": 12.5, "busy": 7.5, "nccl": 5.0, "overlapped": 2.5, "idle": 2.5}


def test_ddp_options_runs_the_named_settings_beside_ddp_regional_and_refuses_unknown_ones():
    sys.path.insert(0, str(ROOT))
    from benchmarks.distributed import OPTION_RUNS, option_runs

    assert option_runs("") == OPTION_RUNS
    assert option_runs("ddp_on_one_gpu,big_buckets") == [
        ("ddp", "regional", "", 1), ("ddp", "regional", "", 2),
        ("ddp", "regional", "ddp_on_one_gpu", 1), ("ddp", "regional", "big_buckets", 2),
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"unknown --ddp-options \['big_bucket'\]: choose from .*'big_buckets'"):
        option_runs("big_bucket")
