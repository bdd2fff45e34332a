"""How the optimizer's Triton kernel's block size and warps set its speed: AdamW over GPT-2 small's parameters
(the step alone, a fresh gradient tensor per parameter before each step, as ``benchmarks/optimizer.py``), fused
AdamW timed in the same process for reference. Chose ``triton_update.BLOCK`` and ``NUM_WARPS``.

    python benchmarks/optimizer_kernel_sweep.py --out benchmarks/results/experiments/optimizer_kernel_sweep.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import StepTimer, format_table, write_result  # noqa: E402
from benchmarks.models import GPT2_SMALL  # noqa: E402
from benchmarks.optimizer import LR, MAX_NORM, WEIGHT_DECAY, set_grads  # noqa: E402
from compile_trainer.optimizer import compile_optimizer, triton_update  # noqa: E402
from recipes.gpt import GPT  # noqa: E402

TITLE = "The optimizer's Triton kernel: block size and warps (AdamW over GPT-2 small's parameters, step alone)"
COLUMNS = ["variant", "step_ms", "vs_fused"]
NOTE = "median of {steps} steps after 10; fused AdamW (after clip_grad_norm_ for the + clip rows) in the same process"
CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def time_steps(params, grads, policy, clip: bool, steps: int) -> float:
    """Median ms of ``steps`` AdamW steps (after 10); ``policy`` None: fused AdamW, after ``clip_grad_norm_`` with
    ``clip`` (a policy clips inside)."""
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=policy is None)
    clip = clip and policy is None
    if policy is not None:
        compile_optimizer(optimizer, policy)
    timer = StepTimer(torch.device("cuda"))
    for _ in range(10 + steps):
        set_grads(params, grads)
        started = timer.start()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        timer.stop(started)
    return 1000 * statistics.median(timer.seconds()[10:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    initial = [p.detach() for p in GPT(GPT2_SMALL).cuda().parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in initial]
    rows = []
    for clip in (False, True):
        extra = {"clip_grad_norm": MAX_NORM} if clip else {}
        fused = time_steps([torch.nn.Parameter(p.clone()) for p in initial], grads, None, clip, args.steps)
        rows.append({"variant": "fused" + " + clip" * clip, "step_ms": fused})
        for block, warps in CONFIGS:
            triton_update.BLOCK, triton_update.NUM_WARPS = block, warps
            params = [torch.nn.Parameter(p.clone()) for p in initial]
            ms = time_steps(params, grads, {"compile": "true", "kernel": "triton", **extra}, clip, args.steps)
            rows.append({"variant": f"triton block {block} warps {warps}" + " + clip" * clip, "step_ms": ms})
            rows[-1]["vs_fused"] = fused / ms
            print(rows[-1], flush=True)
    write_result(args.out, "optimizer_kernel_sweep", TITLE, COLUMNS, rows, [NOTE.format(steps=args.steps)])
    print(format_table(COLUMNS, rows))


if __name__ == "__main__":
    main()
