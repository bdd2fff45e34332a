"""How the optimizer's Triton kernel's block size and warps set its speed: AdamW over GPT-2 small's parameters (the
step alone, as ``benchmarks/optimizer.py``), fused AdamW timed in the same process for reference (GPU only):

    python benchmarks/optimizer_kernel_sweep.py --out benchmarks/results/experiments/optimizer_kernel_sweep.json
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.optimizer import LR, MAX_NORM, WEIGHT_DECAY, parameters, set_grads  # noqa: E402
from compile_trainer.optimizer import compile_optimizer, triton_update  # noqa: E402

CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def measure(args) -> dict:
    """Median ms of ``--steps`` steps after 10: fused AdamW (after ``clip_grad_norm_`` with clipping), or the Triton
    kernel with the run's block size and warps (clipping inside)."""
    initial, grads = parameters(args)
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=args.block is None)
    if args.block is not None:
        triton_update.BLOCK, triton_update.NUM_WARPS = args.block, args.warps
        compile_optimizer(optimizer, {"compile": "true", "kernel": "triton"} | {"clip_grad_norm": MAX_NORM} * args.clip)
    timer = common.StepTimer(torch.device("cuda"))
    for _ in range(10 + args.steps):
        set_grads(params, grads)
        started = timer.start()
        if args.clip and args.block is None:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        timer.stop(started)
    return {"step_ms": 1000 * statistics.median(timer.seconds()[10:])}


def runs(args) -> list:
    sweep = [(None, None), *CONFIGS]
    names = ["fused" if block is None else f"triton block {block} warps {warps}" for block, warps in sweep]
    return [
        {"variant": name + " + clip" * clip, "_block": block, "_warps": warps, "_clip": clip}
        for clip in (False, True)
        for name, (block, warps) in zip(names, sweep)
    ]


def vs_fused(rows: list, args) -> list:
    clipped = lambda row: "clip" in row["variant"]  # noqa: E731
    common.add_ratio(rows, "vs_fused", "step_ms", lambda row: row["variant"].startswith("fused"), clipped, True)
    return rows


BENCHMARK = common.Benchmark(
    name="optimizer_kernel_sweep",
    title="The optimizer's Triton kernel: block size and warps (AdamW over GPT-2 small's parameters, step alone)",
    columns=["variant", "step_ms", "vs_fused"],
    runs=runs,
    measure=measure,
    shared=dict(steps=200),
    finish=vs_fused,
    notes=lambda args, rows: [
        f"median of {args.steps} steps after 10; fused AdamW (after clip_grad_norm_ for the + clip rows) in the same "
        "process"
    ],
    in_process=True,
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
