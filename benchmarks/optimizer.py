"""Optimizer-step benchmark: AdamW over GPT-2 small's parameters, this project's compiled step (the Triton kernel,
the Inductor update, ``auto``) against torch's foreach and fused AdamW, each with and without
``clip_grad_norm_(1.0)``; every road's parameters against torch's for-loop AdamW after 100 steps and at the end.
How the rows are timed: docs/optimizer.md ("The benchmark").

    python benchmarks/optimizer.py --out benchmarks/results/optimizer.json   # GPU
    TRITON_INTERPRET=1 python benchmarks/optimizer.py --smoke --out /tmp/optimizer.json   # CPU, as CI runs it
"""

import functools
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch._dynamo.utils import counters, get_compilation_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer.optimizer import CompiledOptimizerStep, compile_optimizer  # noqa: E402
from compile_trainer.schema import OptimizerPolicy  # noqa: E402
from compile_trainer_recipes.gpt import GPT, GPTConfig, warmup_cosine_factor  # noqa: E402

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LR, BETAS, WEIGHT_DECAY, MAX_NORM = 6e-4, (0.9, 0.95), 0.1, 1.0
PASSES = 7  # AdamW moves 7 x the parameter bytes per step
PARITY_STEP = 100  # parameters compared with the reference after this many steps, and at the end
CLIPPED = " + clip"  # a variant that clips gradients by norm: the road's name and this
# torch's single-tensor AdamW (+ clip_grad_norm_ over the same for-loop): the implementation the compiled update
# follows op for op, and every road's parity reference (fused is another rounding of the same update).
EAGER = "eager for-loop"
PEERS = {EAGER: {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# This project's step: the Triton kernel (what ``kernel: auto`` runs on a GPU; on the CPU smoke run, through
# Triton's interpreter: TRITON_INTERPRET=1), the torch.compile'd update over flat gradient buffers, and ``auto``
# (which times the candidates on the real parameters in the first steps and keeps the fastest).
POLICIES = {
    "compile_trainer": {"compile": "true", "kernel": "triton"},
    "compile_trainer inductor": {"compile": "true", "kernel": "inductor"},
    "compile_trainer auto": {"compile": "auto"},
}
VARIANTS = [road + clip for road in (*PEERS, *POLICIES) for clip in ("", CLIPPED)]
COLUMNS = """variant step_ms ratio vs_fused gb_per_s host_ms first_steps_s compile_s recompiles graph_breaks
max_rel_diff_at_100 max_abs_diff error""".split()


def make_optimizer(variant: str, params: List[torch.Tensor], backend: str, steps: int):
    """The variant's AdamW (compiled as its policy says, clipping inside), its LR schedule, and its step."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    road, clip = variant.removesuffix(CLIPPED), variant.endswith(CLIPPED)
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **PEERS.get(road, {}))
    schedule = functools.partial(warmup_cosine_factor, warmup=max(1, steps // 10), decay=steps)  # the recipe's, to 10%
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if road in POLICIES:  # after the scheduler, as in Lightning
        policy = OptimizerPolicy(**POLICIES[road], clip_grad_norm=MAX_NORM if clip else None)
        compile_optimizer(optimizer, policy, backend=backend)

    def step() -> None:
        if clip and road in PEERS:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=False if road == EAGER else None)
        optimizer.step()

    return optimizer, scheduler, step


def run_variant(variant: str, initial: List[torch.Tensor], grads: List[torch.Tensor], args: Any):
    """The variant's row, and its parameters after ``PARITY_STEP`` steps and at the end. Before every step each
    parameter gets its own gradient tensor again, as a backward after ``zero_grad(set_to_none=True)`` leaves it."""
    params = [torch.nn.Parameter(t.clone()) for t in initial]
    grads = [g.clone() for g in grads]  # clip_grad_norm_ clips them in place
    optimizer, scheduler, step = make_optimizer(variant, params, args.backend, args.steps)
    compiled = optimizer.__dict__.get("step")
    compiled = compiled if isinstance(compiled, CompiledOptimizerStep) else None
    # steps that compile or run auto's trial, not steady state: the first 2, or the trial and 2 more
    warmup = 2 + (len(compiled._trial.schedule) if compiled is not None and compiled._trial is not None else 0)
    timer, host_ms, snapshots, kernels_at_warmup = common.StepTimer(initial[0].device), [], [], 0
    for index in range(args.steps):
        if index == warmup and compiled is not None:
            kernels_at_warmup = len(getattr(compiled.update, "specializations", ()))
        if index == min(PARITY_STEP, args.steps - 1):
            snapshots.append([p.detach().clone() for p in params])
        for param, grad in zip(params, grads):
            param.grad = grad
        started, host_start = timer.start(), time.perf_counter()
        step()
        host_ms.append(1000 * (time.perf_counter() - host_start))
        timer.stop(started)
        scheduler.step()
    step_ms = [1000 * s for s in timer.seconds()]
    steady_ms, compiles = statistics.median(step_ms[warmup:]), get_compilation_metrics()
    row: Dict[str, Any] = {
        "step_ms": steady_ms,
        "gb_per_s": PASSES * sum(p.numel() * p.element_size() for p in params) / steady_ms / 1e6,
        "host_ms": statistics.median(host_ms[warmup:]),
        "first_steps_s": sum(step_ms[:warmup]) / 1000,
        "compile_s": sum(common.frame_compile_seconds(m) for m in compiles),
        "frames_compiled": len(compiles),
        "recompiles": sum(1 for m in compiles if common.is_recompile(m)),
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    if compiled is not None:
        update, choice = compiled.update, compiled.choice
        row |= {"kernel": update.describe(), "auto_choice": asdict(choice) if choice else None}
        row |= {"compiled_steps": compiled.compiled_steps, "eager_steps": compiled.eager_steps}
        if update.name == "triton":  # a kernel per set of compile-time constants: one after the first steps recompiled
            row["kernels_compiled"] = len(update.specializations)
            row["recompiles"] += len(update.specializations) - kernels_at_warmup
    return row, [*snapshots, [p.detach() for p in params]]


REFERENCES: Dict[str, List[List[torch.Tensor]]] = {}  # a parity reference's parameters after 100 steps, at the end


@functools.cache
def parameters(smoke: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """GPT-2 small's (or the tiny model's) initial parameters and a gradient for each, made once a process."""
    device = common.device_for(smoke)
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in GPT(TINY if smoke else models.GPT2_SMALL).to(device).parameters()]
    generator = torch.Generator(device=device).manual_seed(1)
    return initial, [torch.randn(t.shape, device=device, generator=generator) * 1e-3 for t in initial]


def measure(args: Any) -> Dict[str, Any]:
    """The variant's row, its parameters against its parity reference's."""
    if hasattr(torch._dynamo.utils, "set_compilation_metrics_limit"):
        torch._dynamo.utils.set_compilation_metrics_limit(100_000)
    torch._dynamo.config.recompile_limit = 64  # so recompiles are counted, not hidden by a fallback to eager
    initial, grads = parameters(args.smoke)
    row, snapshots = run_variant(args.variant, initial, grads, args)
    reference = EAGER + CLIPPED if args.variant.endswith(CLIPPED) else EAGER
    if args.variant == reference:
        REFERENCES[reference] = snapshots
    if reference in REFERENCES:  # the largest difference, relative to each tensor's largest value
        early, final = REFERENCES[reference]
        row["max_rel_diff_at_100"] = max(
            (a - b).abs().max().item() / b.abs().max().item() for a, b in zip(snapshots[0], early)
        )
        row["max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(snapshots[-1], final))
    return row


def with_ratios(rows: List[Dict[str, Any]], args: Any) -> List[Dict[str, Any]]:
    """``ratio``: each road's step time over its reference's (fused, or fused + clip for the rows that clip);
    ``vs_fused``: the inverse."""
    reference = lambda row: "fused + clip" if row["variant"].endswith(CLIPPED) else "fused"  # noqa: E731
    for name, inverse in (("ratio", False), ("vs_fused", True)):
        common.add_ratio(rows, name, "step_ms", lambda row: row["variant"] == reference(row), reference, inverse)
    return rows


def notes(args: Any, rows: List[Dict[str, Any]]) -> List[str]:
    initial, _ = parameters(args.smoke)
    param_bytes = sum(t.numel() * t.element_size() for t in initial)
    notes = [
        f"AdamW over {sum(t.numel() for t in initial) / 1e6:.1f}M fp32 parameters ({param_bytes / 1e6:.0f} MB) in "
        f"2 groups, backend {args.backend}, {args.steps} scheduled steps per variant (warm-up + cosine), fresh "
        "compile caches each"
    ]
    for row in rows:
        if row.get("auto_choice"):
            choice = row["auto_choice"]
            trial = {name: round(ms, 3) for name, ms in choice["step_ms"].items()}
            notes.append(f"{row['variant']}: chose {choice['chosen']}; trial ms {trial}; skipped {choice['skipped']}")
    return notes


BENCHMARK = common.Benchmark(
    name="optimizer",
    title="AdamW step over GPT-2 small's parameters",
    columns=COLUMNS,
    runs=lambda args: [{"variant": v} for v in args.variants],
    measure=measure,
    shared=dict(steps=1000, backend="inductor"),
    options={"--variants": dict(nargs="+", choices=VARIANTS, default=VARIANTS)},
    smoke=dict(steps=20, backend="aot_eager"),
    finish=with_ratios,
    notes=notes,
    in_process=True,
    baseline="fused, or fused + clip for the rows that clip (ratio, vs_fused)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
