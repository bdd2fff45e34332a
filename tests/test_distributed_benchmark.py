"""The multi-GPU benchmark's CPU smoke mode (2 gloo processes, a tiny GPT), run as on the GPU image: hydra and
wandb unimportable (omegaconf is carried there); where a profiled step's GPU time went, from a Chrome trace."""

import json
import subprocess
import sys

import pytest

from benchmarks.distributed import gpu_timeline
from tests.benchmark_smoke import ROOT

WITHOUT_HYDRA_AND_WANDB = (
    "import runpy, sys\n"
    "for name in ('hydra', 'wandb'):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_distributed_benchmark_smoke_runs_ddp_fsdp2_and_the_cache_on_1_and_2_processes(tmp_path):
    """The HF Llama path (its blocks sharded under FSDP2 with bf16 parameters), one device against two, each
    strategy's warm cache row, and the link measured in each job on two."""
    out = tmp_path / "distributed.json"
    script = ["benchmarks/distributed.py", "--smoke", "--models", "llama", "--policies", "regional", "--out", str(out)]
    script += ["--experiments", "scaling,cache"]
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYDRA_AND_WANDB, *script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "distributed" and data["notes"] and "distributed.py --smoke" in data["meta"]["command"]
    rows = {(row["experiment"], row["strategy"], row["gpus"]): row for row in data["rows"]}
    assert list(rows) == [
        ("scaling", "-", 1), ("scaling", "ddp", 2), ("scaling", "fsdp2", 2), ("cache", "ddp", 2), ("cache", "fsdp2", 2)
    ]  # fmt: skip
    for key, row in rows.items():
        gpus = key[2]
        assert row["error"] is None, (key, row["error"])
        assert row["samples_per_s"] > 0 and all(s > 0 for s in row["first_step_s_by_rank"])
        assert len(row["first_step_s_by_rank"]) == len(row["recompiles_by_rank"]) == gpus
        assert len(row["step_ms_median_by_rank"]) == gpus and all(m > 0 for m in row["step_ms_median_by_rank"])
        assert row["divergent_ranks"] == [] and row["scaling_vs_1"] > 0 and row["first_step_vs_1"] > 0
        assert row["batch"] == 2
    assert rows["scaling", "-", 1]["scaling_vs_1"] == 1.0 and "comm_mb" not in rows["scaling", "-", 1]
    for strategy in ("ddp", "fsdp2"):
        cold, warm = rows["scaling", strategy, 2]["cache"], rows["cache", strategy, 2]["cache"]
        assert cold["status"] == "miss" and cold["precompiled_captures"] >= 1  # rank 0 wrote the bundle
        assert warm["status"] == "hit" and warm["precompiled_hits"] > 0  # a new machine was served from it
    ddp, fsdp2 = rows["scaling", "ddp", 2], rows["scaling", "fsdp2", 2]
    assert fsdp2["fsdp"] == "bf16/fp32" and ddp["fsdp"] == "-"
    # the link, probed in each job at the sizes its step moves: DDP all-reduces fp32 gradients, FSDP2 gathers bf16
    # parameters (twice for all but the root and the last block) and reduce-scatters fp32 gradients
    params = ddp["link"]["parameters"]
    assert ddp["link"]["bytes_by_collective"] == {"all_reduce": 4 * params} and ddp["comm_mb"] > 0
    assert fsdp2["link"]["bytes_by_collective"]["reduce_scatter"] == 4 * params
    assert 2 * params < fsdp2["link"]["bytes_by_collective"]["all_gather"] < 4 * params
    for row in (ddp, fsdp2):
        measured = row["link"]["probe"]["measurements"]
        assert {(m["collective"], m["dtype"]) for m in measured} == {
            (c, d) for c in ("all_reduce", "all_gather", "reduce_scatter") for d in ("bfloat16", "float32")
        }
        assert row["comm_ms"] > 0 and 0 < row["serial_ms"] <= row["comm_ms"]
        # no profile on the CPU: the one-device row's step stands for compute
        assert row["gpu_timeline_ms_a_step"] is None and row["compute_ms"] is None
        host = row["host_ms_a_step"]  # the host's time, profiled on the CPU too
        assert host["wall"] > 0 and len(host["top_self"]) == 10 and all(ms >= 0 for ms in host["top_self"].values())
        assert 0 < host["fsdp_hooks"] < host["wall"] if row is fsdp2 else host["fsdp_hooks"] == 0
        one = max(rows["scaling", "-", 1]["step_ms_median_by_rank"])
        assert row["limit_ms"] == pytest.approx(max(one + row["serial_ms"], row["comm_ms"]), abs=1e-3)
        assert row["vs_limit"] == pytest.approx(max(row["step_ms_median_by_rank"]) / row["limit_ms"])
    assert "vs_limit" in result.stdout  # the table


def test_gpu_timeline_splits_a_step_into_compute_nccl_overlap_and_idle():
    """Two steps: compute 0-10 and 12-20 us, an all-gather 5-14 (4 us of it alone), a reduce-scatter 22-25 (alone),
    a CPU event that is not a kernel."""
    events = [
        {"cat": "kernel", "name": "ampere_sgemm", "ts": 0, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 12, "dur": 8},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 5, "dur": 9},
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ts": 22, "dur": 3},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
    ]
    timeline = gpu_timeline(events, steps=2)
    # busy 18 us, nccl 12 (9 + 3), overlapped 5 + 2 = 7, exposed 5, span 25, idle 25 - 23 = 2; ms a step
    assert timeline == {
        "span": 0.0125, "busy": 0.009, "nccl": 0.006, "overlapped": 0.0035, "exposed": 0.0025, "idle": 0.001,
        "nccl_by_collective": {"all_gather": 0.0045, "reduce_scatter": 0.0015, "all_reduce": 0.0},
    }  # fmt: skip
    assert gpu_timeline([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3}], steps=1) == {}
