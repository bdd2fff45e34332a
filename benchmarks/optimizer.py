"""AdamW step over GPT-2 small's parameters: torch's foreach and fused kernels, ``torch.compile(opt.step)`` and
compile_trainer's compiled step, side by side in one process.

    python -m benchmarks.optimizer --out optimizer.json             # GPU: GPT-2 small, 1,000 scheduled steps
    python -m benchmarks.optimizer --smoke --out /tmp/smoke.json    # CPU: a tiny GPT, seconds

Every variant starts from the same parameters, gradients and optimizer state and runs the same warm-up + cosine
LR schedule (stepped after every optimizer step, outside the timed region). Reported per variant: the median step
time (CUDA events around ``step()``; wall clock on the CPU), effective bandwidth (7 x parameter bytes per step:
read param, grad, exp_avg, exp_avg_sq; write three), the time of the first steps (where compilation happens) and
Dynamo's own compile time, recompiles and graph breaks over all steps, and the largest parameter difference from
the foreach variant at the end (all variants compute the same update). A device-to-device copy gives the floor.
Needs torch and lightning only (no hydra, omegaconf or wandb).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch._dynamo.utils import counters, get_compilation_metrics

from compile_trainer.optimizer import CompiledOptimizerStep, compile_optimizer
from compile_trainer.policy import OptimizerPolicy
from recipes.gpt import GPT, GPTConfig

GPT2_SMALL = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LR, BETAS, WEIGHT_DECAY = 6e-4, (0.9, 0.95), 0.1
BYTES_PER_PARAM_BYTE = 7  # AdamW: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


@dataclass
class Result:
    variant: str
    step_ms_median: float = math.nan
    step_ms_mean: float = math.nan
    host_ms_median: float = math.nan  # CPU time to issue a step
    kernels_per_step: float = math.nan  # GPU only, from the profiler
    gpu_kernel_ms_per_step: float = math.nan  # GPU only: time the GPU spends in the step's kernels
    bandwidth_gbs: float = math.nan
    first_steps_s: float = math.nan  # wall time of the steps that compile (and auto's trial)
    compile_s: float = 0.0  # Dynamo's entire_frame_compile_time_s over the variant's compiles
    frames_compiled: int = 0
    recompiles: int = 0
    graph_breaks: int = 0
    max_abs_diff_vs_foreach: float = math.nan
    compile_phases_s: Dict[str, float] = field(default_factory=dict)
    details: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% (the recipe's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(params: List[torch.Tensor]) -> List[Dict[str, Any]]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


POLICIES = {
    "compile_trainer": OptimizerPolicy(compile="true"),
    "compile_trainer combo_kernels": OptimizerPolicy(compile="true", options={"combo_kernels": True}),
    "compile_trainer max-autotune": OptimizerPolicy(compile="true", mode="max-autotune-no-cudagraphs"),
    "compile_trainer reduce-overhead": OptimizerPolicy(compile="true", mode="reduce-overhead"),
    "compile_trainer auto": OptimizerPolicy(compile="auto"),
}


def make_optimizer(variant: str, params: List[torch.Tensor], device: torch.device, backend: str, steps: int):
    """The optimizer for ``variant``, its LR schedule, and the callable that steps it."""
    groups = param_groups(params)
    on_gpu = device.type != "cpu"
    if variant == "torch.compile(opt.step)":
        # The documented recipe: tensor LR (needs capturable with foreach, which is GPU-only).
        lr = torch.tensor(LR, device=device if on_gpu else "cpu")
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=BETAS, foreach=on_gpu, capturable=on_gpu)
    else:
        flags = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(variant, {})
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **flags)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, max(1, steps // 10), steps))
    if variant == "torch.compile(opt.step)":
        return optimizer, scheduler, torch.compile(optimizer.step, backend=backend)
    if variant in POLICIES:
        compile_optimizer(optimizer, POLICIES[variant], backend=backend)  # after the scheduler, as in Lightning
    return optimizer, scheduler, lambda: optimizer.step()


GPU_ONLY = ("compile_trainer combo_kernels", "compile_trainer max-autotune", "compile_trainer reduce-overhead")
VARIANTS = (
    "foreach",
    "fused",
    "torch.compile(opt.step)",
    "compile_trainer",
    "compile_trainer combo_kernels",
    "compile_trainer max-autotune",
    "compile_trainer reduce-overhead",
    "compile_trainer auto",
)


class StepTimer:
    """Per-step times: CUDA events on a GPU (they include time the GPU waits for the CPU), wall clock on a CPU.

    ``host`` is the CPU time to issue each step (no synchronization): where it reaches the GPU time, the step is
    bound by the CPU (guards, Python, kernel launches), not by memory bandwidth.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pairs: List[Tuple[Any, Any]] = []
        self.host: List[float] = []

    def time(self, fn: Callable[[], Any]) -> None:
        on_gpu = self.device.type == "cuda"
        start_event = torch.cuda.Event(enable_timing=True) if on_gpu else None
        end_event = torch.cuda.Event(enable_timing=True) if on_gpu else None
        if on_gpu:
            start_event.record()
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        self.host.append(1000 * (end - start))
        if on_gpu:
            end_event.record()
            self.pairs.append((start_event, end_event))

    def milliseconds(self) -> List[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) for start, end in self.pairs]
        return list(self.host)


def profile_kernels(step: Callable[[], Any], scheduler: Any, steps: int = 20) -> Dict[str, float]:
    """Kernels launched and GPU time spent in them per step (the profiler's device events)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            scheduler.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_kernel_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels) / steps / 1000,
    }


COMPILE_PHASES = {  # CompilationMetrics fields (microseconds) -> seconds in the report
    "dynamo": "dynamo_cumulative_compile_time_us",
    "aot_autograd": "aot_autograd_cumulative_compile_time_us",
    "inductor": "inductor_cumulative_compile_time_us",
    "inductor_code_gen": "inductor_code_gen_cumulative_compile_time_us",
    "triton_compile": "triton_compile_time_us",
    "runtime_triton_autotune": "runtime_triton_autotune_time_us",
}


def fresh_compile_caches():
    """Cold compiles for every variant (Inductor's on-disk caches would hide compile time after the first)."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    return fresh() if fresh is not None else contextlib.nullcontext()


def warmup_steps(step_object: Any) -> int:
    """Steps whose time is compile or trial, not steady state: the first 2, or auto's whole trial and one more."""
    trial = getattr(step_object, "_trial", None)
    return 2 + (len(trial.schedule) if trial is not None else 0)


def run_variant(
    variant: str,
    initial: List[torch.Tensor],
    grads: List[torch.Tensor],
    device: torch.device,
    steps: int,
    backend: str,
) -> Tuple[Result, List[torch.Tensor]]:
    result = Result(variant)
    params = [torch.nn.Parameter(t.clone()) for t in initial]
    for param, grad in zip(params, grads):
        param.grad = grad
    torch._dynamo.reset()
    seen_metrics = {id(m) for m in get_compilation_metrics()}
    breaks_before = sum(counters["graph_break"].values())
    with fresh_compile_caches():
        optimizer, scheduler, step = make_optimizer(variant, params, device, backend, steps)
        compiled_step = optimizer.__dict__.get("step")
        warmup = warmup_steps(compiled_step) if isinstance(compiled_step, CompiledOptimizerStep) else 2
        timer = StepTimer(device)
        for _ in range(steps):
            timer.time(step)
            scheduler.step()
        times = timer.milliseconds()
        kernels = {}
        if device.type == "cuda":
            try:
                kernels = profile_kernels(step, scheduler)
            except Exception as error:  # the timings above still count
                result.details["profile_error"] = repr(error)
    compiles = [m for m in get_compilation_metrics() if id(m) not in seen_metrics]
    steady = times[warmup:] or times
    result.step_ms_median = statistics.median(steady)
    result.step_ms_mean = statistics.fmean(steady)
    result.host_ms_median = statistics.median(timer.host[warmup:] or timer.host)
    result.kernels_per_step = kernels.get("kernels_per_step", math.nan)
    result.gpu_kernel_ms_per_step = kernels.get("gpu_kernel_ms_per_step", math.nan)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    result.bandwidth_gbs = BYTES_PER_PARAM_BYTE * param_bytes / (result.step_ms_median / 1000) / 1e9
    result.first_steps_s = sum(times[:warmup]) / 1000
    result.compile_s = sum(getattr(m, "entire_frame_compile_time_s", None) or 0.0 for m in compiles)
    result.frames_compiled = len(compiles)
    result.recompiles = sum(1 for m in compiles if is_recompile(m))
    result.graph_breaks = sum(counters["graph_break"].values()) - breaks_before
    result.compile_phases_s = {
        phase: sum(getattr(m, name, None) or 0 for m in compiles) / 1e6 for phase, name in COMPILE_PHASES.items()
    }
    if isinstance(compiled_step, CompiledOptimizerStep):
        result.details |= {
            "compile_kwargs": {k: v for k, v in compiled_step.compile_kwargs.items() if v is not None},
            "compiled_steps": compiled_step.compiled_steps,
            "eager_steps": compiled_step.eager_steps,
            "auto_choice": asdict(compiled_step.choice) if compiled_step.choice else None,
        }
    return result, [p.detach() for p in params]


def is_recompile(metrics: Any) -> bool:
    """A compile id "frame/attempt" with attempt > 0 is a recompile of that frame."""
    match = re.search(r"(\d+)/(\d+)", str(metrics.compile_id))
    return bool(match) and int(match.group(2)) > 0


def copy_floor(param_bytes: int, device: torch.device) -> Dict[str, float]:
    """A device-to-device copy of the parameter bytes: its bandwidth bounds any optimizer step."""
    source = torch.empty(param_bytes // 4, device=device)
    target = torch.empty_like(source)
    timer = StepTimer(device)
    for _ in range(30):
        timer.time(lambda: target.copy_(source))
    seconds = statistics.median(timer.milliseconds()[5:]) / 1000
    copy_gbs = 2 * param_bytes / seconds / 1e9
    return {"copy_gbs": copy_gbs, "floor_ms": 1000 * BYTES_PER_PARAM_BYTE * param_bytes / (copy_gbs * 1e9)}


def format_table(results: List[Result], header: str) -> str:
    fused = next((r.step_ms_median for r in results if r.variant == "fused" and r.error is None), math.nan)
    titles = ["variant", "step ms", "GB/s", "vs fused", "host ms", "GPU ms", "kernels", "first steps s", "compile s"]
    titles += ["recompiles", "breaks", "max|d|"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.variant, f"error: {r.error.strip().splitlines()[-1][:80]}"] + [""] * (len(titles) - 2))
            continue
        rows.append(
            [
                r.variant,
                f"{r.step_ms_median:.3f}",
                f"{r.bandwidth_gbs:,.0f}",
                f"{fused / r.step_ms_median:.2f}x" if not math.isnan(fused) else "-",
                f"{r.host_ms_median:.3f}",
                f"{r.gpu_kernel_ms_per_step:.3f}",
                f"{r.kernels_per_step:.0f}",
                f"{r.first_steps_s:.2f}",
                f"{r.compile_s:.2f}",
                str(r.recompiles),
                str(r.graph_breaks),
                f"{r.max_abs_diff_vs_foreach:.1e}",
            ]
        )
    widths = [max(len(t), *(len(row[i]) for row in rows)) for i, t in enumerate(titles)]
    lines = [header, "  ".join(t.ljust(w) for t, w in zip(titles, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for r in results:
        choice = r.details.get("auto_choice")
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r.compile_phases_s.items() if v)
        if phases:
            lines.append(f"{r.variant}: compile seconds by phase: {phases}")
        if choice:
            step_ms = {name: round(ms, 3) for name, ms in choice["step_ms"].items()}
            lines.append(f"{r.variant}: chose {choice['chosen']}; trial step ms {step_ms}; skipped {choice['skipped']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU with aot_eager, 20 steps")
    parser.add_argument("--steps", type=int, help="scheduled steps per variant (default 1000; smoke 20)")
    parser.add_argument("--backend", help="torch.compile backend (default inductor; smoke aot_eager)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="run only these")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    steps = args.steps or (20 if args.smoke else 1000)
    backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    variants = args.variants or [v for v in VARIANTS if device.type == "cuda" or v not in GPU_ONLY]
    if hasattr(torch._dynamo.utils, "set_compilation_metrics_limit"):
        torch._dynamo.utils.set_compilation_metrics_limit(100_000)
    torch._dynamo.config.recompile_limit = 64  # so recompiles are counted, not hidden by a fallback to eager

    torch.manual_seed(0)
    model = GPT(TINY if args.smoke else GPT2_SMALL).to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    del model
    generator = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(t.shape, device=device, generator=generator) * 1e-3 for t in initial]
    param_bytes = sum(t.numel() * t.element_size() for t in initial)

    results: List[Result] = []
    reference: Optional[List[torch.Tensor]] = None
    for variant in variants:
        try:
            result, final = run_variant(variant, initial, grads, device, steps, backend)
        except Exception:  # one variant failing must not cost the others' measurements
            results.append(Result(variant, error=traceback.format_exc()))
            continue
        if variant == "foreach":
            reference = final
        if reference is not None:
            result.max_abs_diff_vs_foreach = max((a - b).abs().max().item() for a, b in zip(final, reference))
        results.append(result)
        del final

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    floor = copy_floor(param_bytes, device)
    header = (
        f"AdamW over {sum(t.numel() for t in initial) / 1e6:.1f}M fp32 parameters ({param_bytes / 1e6:.0f} MB) "
        f"on {name}, torch {torch.__version__}, backend {backend}, {steps} scheduled steps per variant; "
        f"copy {floor['copy_gbs']:,.0f} GB/s, so the floor is {floor['floor_ms']:.3f} ms"
    )
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "backend": backend,
        "steps": steps,
        "params": sum(t.numel() for t in initial),
        "param_bytes": param_bytes,
        **floor,
        "results": [asdict(r) for r in results],
    }
    print(format_table(results, header))
    for r in results:
        if r.error:
            print(f"\n{r.variant} failed:\n{r.error}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
