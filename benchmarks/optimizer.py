"""Optimizer-step benchmark: AdamW over GPT-2 small's parameters (foreach, fused, ``torch.compile(opt.step)`` and
this project's compiled step, with and without ``clip_grad_norm_(1.0)``): the step alone, in training behind a cheap
backward, and GPT-2 small trained end to end by Lightning (``train_step.py``'s worker). Rows and how each is timed:
docs/optimizer.md ("The benchmark"). GPU run, whole or in two (``--append`` adds to the first's rows):

    python benchmarks/optimizer.py --out benchmarks/results/optimizer.json
    python benchmarks/optimizer.py --no-end-to-end --out benchmarks/results/optimizer.json
    python benchmarks/optimizer.py --only-end-to-end --append --out benchmarks/results/optimizer.json

CPU smoke run, as CI runs it: ``TRITON_INTERPRET=1 python benchmarks/optimizer.py --smoke --out /tmp/optimizer.json``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch._dynamo.utils import counters, get_compilation_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import StepTimer, frame_compile_seconds, is_recompile  # noqa: E402
from benchmarks.models import GPT2_SMALL  # noqa: E402
from compile_trainer.optimizer import CompiledOptimizerStep, compile_optimizer  # noqa: E402
from compile_trainer.schema import OptimizerPolicy  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LR, BETAS, WEIGHT_DECAY, MAX_NORM = 6e-4, (0.9, 0.95), 0.1, 1.0
PASSES = 7  # AdamW moves 7 x the parameter bytes per step
PARITY_STEP = 100  # parameters compared with the reference after this many steps, and at the end
CLIPPED = " + clip"  # every variant that clips gradients by norm has this in its name
# ``compile_trainer``: the Triton kernel (what ``kernel: auto`` runs on a GPU; on the CPU smoke run, through
# Triton's interpreter: TRITON_INTERPRET=1); ``inductor``: the torch.compile'd update over flat gradient buffers,
# which reduce-overhead (CUDA graphs) also uses; ``auto`` (the kernel too) as a user gets it.
TRITON = {"compile": "true", "kernel": "triton"}
INDUCTOR = {"compile": "true", "kernel": "inductor"}
POLICIES = {
    "compile_trainer": OptimizerPolicy(**TRITON),
    "compile_trainer + clip": OptimizerPolicy(**TRITON, clip_grad_norm=MAX_NORM),
    "compile_trainer inductor": OptimizerPolicy(**INDUCTOR),
    "compile_trainer inductor + clip": OptimizerPolicy(**INDUCTOR, clip_grad_norm=MAX_NORM),
    "compile_trainer reduce-overhead + clip": OptimizerPolicy(
        compile="true", mode="reduce-overhead", clip_grad_norm=MAX_NORM
    ),
    "compile_trainer auto + clip": OptimizerPolicy(compile="auto", clip_grad_norm=MAX_NORM),
    "compile_trainer inductor + clip, gradients already in the buffer": OptimizerPolicy(
        **INDUCTOR, clip_grad_norm=MAX_NORM
    ),
}
# The step alone, as in training, where the hooks gather gradients into the flat buffer during backward: the
# gradients are set once, so no step after the first copies them (the other rows pay that copy in the step).
GATHERED_IN_BACKWARD = ("compile_trainer inductor + clip, gradients already in the buffer",)
# torch's single-tensor AdamW (+ clip_grad_norm_ over the same for-loop): the implementation the compiled update
# follows op for op, and every variant's parity reference (fused is another rounding of the same update).
EAGER = "eager for-loop"
VARIANTS = (EAGER, EAGER + CLIPPED, "foreach", "fused", "fused + clip", "torch.compile(opt.step)")
VARIANTS += ("torch.compile(opt.step) + clip", *POLICIES)
GPU_ONLY = ("compile_trainer reduce-overhead + clip",)
# The step as training sees it: gradients from a real backward (the same cheap graph for every road), timed as
# backward + step; the backward alone is timed once, without optimizer hooks, and subtracted.
IN_TRAINING = " (in training)"
BACKWARD_ALONE = "backward alone" + IN_TRAINING
TRAINING_ROADS = ("fused", "fused + clip", "compile_trainer", "compile_trainer + clip")
TRAINING_ROADS += ("compile_trainer inductor", "compile_trainer inductor + clip")
TRAINING_VARIANTS = (BACKWARD_ALONE, *(road + IN_TRAINING for road in TRAINING_ROADS))
# The recipe's GPT-2 small trained end to end by Lightning (benchmarks/train_step.py variants, bf16, regional),
# on the GPU only: a real backward, where the hooks' copies run between the model's own kernels. The
# whole training step is timed; the same training with no update is subtracted to give each road's step time.
END_TO_END_SUFFIX = " (GPT-2 small, Lightning)"
NO_UPDATE = "no update" + END_TO_END_SUFFIX
END_TO_END = {
    NO_UPDATE: "lightning_regional_backward_only",
    "fused" + END_TO_END_SUFFIX: "lightning_regional",
    "fused + clip" + END_TO_END_SUFFIX: "lightning_regional_clip_fused_before_step",
    "foreach + clip, gradient_clip_val" + END_TO_END_SUFFIX: "lightning_regional_clip_foreach",
    "compile_trainer" + END_TO_END_SUFFIX: "lightning_regional_compiled_optimizer",
    "compile_trainer + clip, gradient_clip_val" + END_TO_END_SUFFIX: "lightning_regional_clip_compiled_optimizer",
    "compile_trainer inductor" + END_TO_END_SUFFIX: "lightning_regional_compiled_optimizer_inductor",
    "compile_trainer inductor + clip, gradient_clip_val" + END_TO_END_SUFFIX: (
        "lightning_regional_clip_compiled_optimizer_inductor"
    ),
    "compile_trainer auto" + END_TO_END_SUFFIX: "lightning_regional_auto_optimizer",
    "compile_trainer auto + clip, gradient_clip_val" + END_TO_END_SUFFIX: "lightning_regional_clip_auto_optimizer",
}
# Rows timed with more than the step around it: (the row with nothing but that, the column holding the time).
WITH_MORE = {IN_TRAINING: (BACKWARD_ALONE, "backward_step_ms"), END_TO_END_SUFFIX: (NO_UPDATE, "training_step_ms")}
COLUMNS = """variant step_ms backward_step_ms training_step_ms ratio ratio_total gb_per_s vs_fused host_ms
gpu_kernel_ms kernels_per_step first_steps_s compile_s recompiles graph_breaks max_rel_diff_at_100 max_abs_diff
tokens_per_s error""".split()
# CompilationMetrics fields (microseconds), reported in seconds
COMPILE_PHASES = {phase: f"{phase}_cumulative_compile_time_us" for phase in ("dynamo", "aot_autograd", "inductor")}
COMPILE_PHASES |= {"inductor_code_gen": "inductor_code_gen_cumulative_compile_time_us"}
COMPILE_PHASES |= {name: f"{name}_time_us" for name in ("triton_compile", "runtime_triton_autotune")}


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% (the recipe's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def suffix_of(variant: str) -> str:
    """How the row was timed: its suffix in ``WITH_MORE``, or ``""`` for the step alone."""
    return next((suffix for suffix in WITH_MORE if variant.endswith(suffix)), "")


def reference_for(variant: str) -> str:
    """The variant whose step time this one is compared with: fused with the same clipping, timed the same way."""
    return ("fused + clip" if CLIPPED in variant else "fused") + suffix_of(variant)


def parity_reference_for(variant: str) -> str:
    """The variant whose parameters this one is compared with: torch's for-loop AdamW with the same clipping."""
    return EAGER + CLIPPED if CLIPPED in variant else EAGER


def make_optimizer(variant: str, params: List[torch.Tensor], device: torch.device, backend: str, steps: int):
    """The optimizer for ``variant``, its LR schedule, and the callable that steps it."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    on_gpu = device.type != "cpu"
    variant = variant.removesuffix(IN_TRAINING)
    clip = CLIPPED in variant and variant not in POLICIES
    if variant.startswith("torch.compile"):
        # The documented recipe: tensor LR (needs capturable with foreach, which is GPU-only).
        lr = torch.tensor(LR, device=device if on_gpu else "cpu")
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=BETAS, foreach=on_gpu, capturable=on_gpu)
    else:
        flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, EAGER: {"foreach": False}}
        flags = flags.get(variant.removesuffix(CLIPPED), {})
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **flags)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, max(1, steps // 10), steps))
    if variant in POLICIES:
        compile_optimizer(optimizer, POLICIES[variant], backend=backend)  # after the scheduler, as in Lightning

    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=False if variant.startswith(EAGER) else None)
        optimizer.step()

    if variant.startswith("torch.compile"):
        return optimizer, scheduler, torch.compile(step, backend=backend)
    return optimizer, scheduler, step


def set_grads(params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """Each parameter's own gradient tensor, as a backward after ``zero_grad(set_to_none=True)`` leaves it."""
    for param, grad in zip(params, grads):
        param.grad = grad


def training_loss(params: List[torch.Tensor], grads: List[torch.Tensor]) -> torch.Tensor:
    """A cheap graph whose backward gives each parameter a new gradient tensor holding ``grads``' values (as a
    model's backward after ``zero_grad(set_to_none=True)``), running every optimizer's gradient hooks."""
    return torch.stack([(param * grad).sum() for param, grad in zip(params, grads)]).sum()


def no_optimizer(params: List[torch.Tensor]) -> Tuple[None, None, Callable[[], None]]:
    """The backward-alone row's stand-in: no optimizer, no hooks, a step that does nothing."""
    return None, None, lambda: None


def profile_kernels(step: Callable[[], Any], scheduler: Any, before: Callable[[], None], steps: int = 20):
    """Kernels launched and GPU time spent in them per step (the profiler's device events)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            before()
            step()
            scheduler.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / steps / 1000,
    }


def warmup_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps that compile or run auto's trial, not steady state: the first 2, or the trial and 2 more."""
    step = optimizer.__dict__.get("step")
    trial = getattr(step, "_trial", None) if isinstance(step, CompiledOptimizerStep) else None
    return 2 + (len(trial.schedule) if trial is not None else 0)


def run_variant(
    variant: str, initial: List[torch.Tensor], grads: List[torch.Tensor], device: torch.device, args: argparse.Namespace
) -> Tuple[Dict[str, Any], List[List[torch.Tensor]]]:
    """The variant's row, and its parameters after ``PARITY_STEP`` steps and at the end."""
    params = [torch.nn.Parameter(t.clone()) for t in initial]
    grads = [g.clone() for g in grads]  # clip_grad_norm_ clips them in place
    row: Dict[str, Any] = {"variant": variant}
    training = IN_TRAINING in variant
    if variant == BACKWARD_ALONE:
        optimizer, scheduler, step = no_optimizer(params)
    else:
        optimizer, scheduler, step = make_optimizer(variant, params, device, args.backend, args.steps)
    compiled_step = optimizer.__dict__.get("step") if optimizer else None
    warmup = warmup_steps(optimizer) if optimizer else 2
    timer, host_ms, snapshots = StepTimer(device), [], []
    kernels_at_warmup = 0
    for index in range(args.steps):
        if index == warmup:
            kernels_at_warmup = len(getattr(getattr(compiled_step, "update", None), "specializations", ()))
        if index == min(PARITY_STEP, args.steps - 1):
            snapshots.append([p.detach().clone() for p in params])
        if training:
            set_grads(params, [None] * len(params))
            loss = training_loss(params, grads)
        elif index == 0 or variant not in GATHERED_IN_BACKWARD:
            set_grads(params, grads)
        started = timer.start()
        host_start = time.perf_counter()
        if training:
            loss.backward()  # the hooks (gradient copy, norm) are timed with the step they serve
        step()
        host_ms.append(1000 * (time.perf_counter() - host_start))
        timer.stop(started)
        if scheduler is not None:
            scheduler.step()
    step_ms = [1000 * s for s in timer.seconds()]
    if device.type == "cuda" and not training:
        try:
            gather = variant not in GATHERED_IN_BACKWARD
            row.update(profile_kernels(step, scheduler, lambda: gather and set_grads(params, grads)))
        except Exception as error:  # the timings above still count
            row["profile_error"] = repr(error)
    compiles = get_compilation_metrics()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    timed = "backward_step_ms" if training else "step_ms"  # in training, the step's share comes in with_ratios
    row[timed] = statistics.median(step_ms[warmup:] or step_ms)
    row[f"{timed}_mean"] = statistics.fmean(step_ms[warmup:] or step_ms)
    if not training:
        row["gb_per_s"] = PASSES * param_bytes / (row["step_ms"] / 1000) / 1e9
    row["host_ms"] = statistics.median(host_ms[warmup:] or host_ms)
    row["first_steps_s"] = sum(step_ms[:warmup]) / 1000
    row["compile_s"] = sum(frame_compile_seconds(m) for m in compiles)
    row["compile_phases_s"] = {
        phase: sum(getattr(m, name, None) or 0 for m in compiles) / 1e6 for phase, name in COMPILE_PHASES.items()
    }
    row["frames_compiled"] = len(compiles)
    row["recompiles"] = sum(1 for m in compiles if is_recompile(m))
    row["graph_breaks"] = sum(counters["graph_break"].values())
    if isinstance(compiled_step, CompiledOptimizerStep):
        update = compiled_step.update
        row["kernel"] = update.describe()
        if update.name == "inductor":
            row["compile_kwargs"] = {k: v for k, v in update.compile_kwargs.items() if v is not None}
        else:  # Triton compiles a kernel per set of compile-time constants: one after the first steps recompiled
            row["kernels_compiled"] = len(update.specializations)
            row["recompiles"] += len(update.specializations) - kernels_at_warmup
        row["compiled_steps"], row["eager_steps"] = compiled_step.compiled_steps, compiled_step.eager_steps
        row["auto_choice"] = asdict(compiled_step.choice) if compiled_step.choice else None
    return row, [*snapshots, [p.detach() for p in params]]


def copy_floor(param_bytes: int, device: torch.device) -> Dict[str, Any]:
    """A device-to-device copy of the parameter bytes (read + write), scaled to AdamW's 7 passes."""
    source = torch.empty(param_bytes // 4, device=device)
    target = torch.empty_like(source)
    timer = StepTimer(device)
    for _ in range(30):
        started = timer.start()
        target.copy_(source)
        timer.stop(started)
    copy_gb_per_s = 2 * param_bytes / statistics.median(timer.seconds()[5:]) / 1e9
    return {"step_ms": 1000 * PASSES * param_bytes / (copy_gb_per_s * 1e9), "gb_per_s": copy_gb_per_s}


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    initial, _ = parameters(args)
    param_bytes = sum(t.numel() * t.element_size() for t in initial)
    notes = [
        f"AdamW over {sum(t.numel() for t in initial) / 1e6:.1f}M fp32 parameters ({param_bytes / 1e6:.0f} MB) in "
        f"2 groups, backend {args.backend}, {args.steps} scheduled steps per variant (warm-up + cosine), fresh "
        "compile caches each"
    ]
    for row in rows:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in row.get("compile_phases_s", {}).items() if v)
        if phases:
            notes.append(f"{row['variant']}: compile seconds by phase: {phases}")
        if row.get("optimizer_choice"):
            notes.append(f"{row['variant']}: {row['optimizer_choice']}")
        choice = row.get("auto_choice")
        if choice:
            trial = {name: round(ms, 3) for name, ms in choice["step_ms"].items()}
            notes.append(f"{row['variant']}: chose {choice['chosen']}; trial ms {trial}; skipped {choice['skipped']}")
    return notes


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The step-alone variants (the device's), the in-training ones, the copy floor, then the end-to-end rows."""
    gpu = common.device_for(args.smoke).type == "cuda"
    variants = args.variants or [v for v in VARIANTS if gpu or v not in GPU_ONLY]
    variants += [] if args.no_training_rows else list(TRAINING_VARIANTS)
    end_to_end = gpu if args.end_to_end is None else args.end_to_end
    if args.only_end_to_end:
        variants, end_to_end = [], True
    step_rows = [{"variant": v} for v in variants] + ([{"variant": "copy floor"}] if variants else [])
    return step_rows + [
        {"variant": name, "_end_to_end": END_TO_END[name]} for name in args.end_to_end_rows * end_to_end
    ]


STATE: Dict[str, Any] = {"references": {}}  # the runs of one process share the parameters and the references


def parameters(args: argparse.Namespace) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """GPT-2 small's (or the tiny model's) initial parameters and a gradient for each, made once a process."""
    if "initial" not in STATE:
        device = common.device_for(args.smoke)
        torch.manual_seed(0)
        STATE["initial"] = [p.detach().clone() for p in GPT(TINY if args.smoke else GPT2_SMALL).to(device).parameters()]
        generator = torch.Generator(device=device).manual_seed(1)
        STATE["grads"] = [torch.randn(t.shape, device=device, generator=generator) * 1e-3 for t in STATE["initial"]]
    return STATE["initial"], STATE["grads"]


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """One row: an end-to-end run, the copy floor, or a variant (parity against its reference's parameters)."""
    if getattr(args, "end_to_end", None):
        return train_end_to_end(args.variant, args.end_to_end, args)
    if hasattr(torch._dynamo.utils, "set_compilation_metrics_limit"):
        torch._dynamo.utils.set_compilation_metrics_limit(100_000)
    torch._dynamo.config.recompile_limit = 64  # so recompiles are counted, not hidden by a fallback to eager
    initial, grads = parameters(args)
    device, references = common.device_for(args.smoke), STATE["references"]
    if args.variant == "copy floor":
        return copy_floor(sum(t.numel() * t.element_size() for t in initial), device)
    row, snapshots = run_variant(args.variant, initial, grads, device, args)
    reference = parity_reference_for(args.variant)
    if args.variant == reference:
        references[args.variant] = snapshots
    if reference in references and args.variant != BACKWARD_ALONE:
        row.update(parameter_differences(snapshots, references[reference]))
    return row


def parameter_differences(snapshots: List[List[torch.Tensor]], reference: List[List[torch.Tensor]]) -> Dict[str, float]:
    """Largest difference from the reference after ``PARITY_STEP`` steps (relative to each tensor's largest
    value) and at the end (absolute)."""
    early = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(snapshots[0], reference[0]))
    final = max((a - b).abs().max().item() for a, b in zip(snapshots[-1], reference[-1]))
    return {"max_rel_diff_at_100": early, "max_abs_diff": final}


def with_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows timed with more than the step (in training: with backward; end to end: the whole training step) get
    their step time as that time less the same for the row with no step. ``ratio`` (step) and ``ratio_total``
    (the whole timed time): this road's over its reference's (fused, or fused + clip, timed the same way), the
    goal's measure; ``vs_fused``: the reference's step time over this one's."""
    by_name = {row["variant"]: row for row in rows}
    baselines = {baseline for baseline, _ in WITH_MORE.values()}
    result = []
    for row in rows:
        variant = row["variant"]
        suffix = suffix_of(variant)
        baseline, column = WITH_MORE.get(suffix, (None, "step_ms"))
        if baseline in by_name and row.get(column) and by_name[baseline].get(column) and variant != baseline:
            row = row | {"step_ms": row[column] - by_name[baseline][column]}
        result.append(row)
    by_name = {row["variant"]: row for row in result}
    for index, row in enumerate(result):
        reference = by_name.get(reference_for(row["variant"]), {}) if row["variant"] not in baselines else {}
        column = WITH_MORE.get(suffix_of(row["variant"]), (None, None))[1]
        ratios = {}
        if row.get("step_ms") and reference.get("step_ms") and row["variant"] not in baselines:
            ratios = {"ratio": row["step_ms"] / reference["step_ms"], "vs_fused": reference["step_ms"] / row["step_ms"]}
        if column and row.get(column) and reference.get(column):
            ratios["ratio_total"] = row[column] / reference[column]
        result[index] = row | ratios
    return result


def train_end_to_end(name: str, variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The recipe's GPT-2 small trained by Lightning in a fresh process (``benchmarks/train_step.py``'s worker)."""
    # 20 steps before timing: auto's trial (its candidates' warm-up and timed steps) is over by then
    command = ["--smoke"] * args.smoke + ["--steps=100", "--warmup=20", f"--backend={args.backend}", "--worker"]
    script = str(Path(__file__).with_name("train_step.py"))
    result = common.fresh_row(script, [*command, json.dumps({"variant": variant})], 300)
    keys = ("tokens_per_s", "peak_mem_gib", "optimizer_choice", "error")
    row = {k: result[k] for k in keys if k in result}
    if "step_ms" in result:
        row["training_step_ms"] = result["step_ms"]
    if "recompile_reasons" in result:
        row["recompiles"], row["graphs"] = len(result["recompile_reasons"]), result["graphs"]
    if "first_step_s" in result:
        row["first_steps_s"] = result["first_step_s"]
    return row


BENCHMARK = common.Benchmark(
    name="optimizer",
    title="AdamW step over GPT-2 small's parameters",
    columns=COLUMNS,
    runs=runs,
    measure=measure,
    shared=dict(steps=1000, backend="inductor"),
    options={
        "--variants": dict(nargs="+", choices=VARIANTS, help="default: all that the device runs"),
        "--no-training-rows": dict(action="store_true", help="skip the in-training rows"),
        "--end-to-end": dict(action=argparse.BooleanOptionalAction, help="also train GPT-2 small (default: on a GPU)"),
        "--only-end-to-end": dict(action="store_true", help="only the GPT-2 small training rows"),
        "--end-to-end-rows": dict(nargs="+", choices=list(END_TO_END), default=list(END_TO_END)),
    },
    smoke=dict(steps=20, backend="aot_eager"),
    smoke_help="tiny model on the CPU with aot_eager, 20 steps",
    finish=lambda rows, args: with_ratios(rows),
    notes=notes,
    in_process=True,
    baseline="fused, or fused + clip for the rows that clip (ratio, vs_fused)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
