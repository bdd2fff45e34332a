"""Training-step benchmark: eager vs torch.compile vs the peers vs this project's policies, side by side; each
variant a fresh process with empty compile caches. GPT-2 small, bf16 autocast, fused AdamW, batch 8 x 1024 (GPU):

    python benchmarks/train_step.py --out benchmarks/results/train_step.json
    python benchmarks/train_step.py --smoke --out /tmp/train_step.json   # CPU, tiny model, aot_eager
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import StepTimer, synchronize  # noqa: E402
from benchmarks.models import GPT2_SMALL, count_flops  # noqa: E402
from recipes.data import read_stdlib_bytes  # noqa: E402
from recipes.gpt import GPT, GPTConfig, LanguageModel  # noqa: E402

SMOKE = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)


@dataclass(frozen=True)
class Variant:
    """One way of training: the loop (``raw`` PyTorch or ``lightning``), how it compiles, a bundled ``policy``
    with ``overrides``, and arguments of the recipe's ``LanguageModel`` (``module``)."""

    loop: str
    how: str
    policy: Optional[str] = None
    overrides: Tuple[Tuple[str, Any], ...] = ()
    module: Tuple[Tuple[str, Any], ...] = ()
    trainer: Tuple[Tuple[str, Any], ...] = ()  # Lightning Trainer arguments
    step: str = "optimizer"  # Lightning: "optimizer", "clip" (clip_grad_norm_ first) or "none" (see OptimizerStepAs)


NO_CUDA_GRAPHS = (("mode", None),)
CLIP_TRAINER = (("gradient_clip_val", 1.0),)
CPP_WRAPPER = (("options", {"cpp_wrapper": True}),)
COMPILED, INDUCTOR = (("optimizer", {"compile": "true"}),), (("optimizer", {"compile": "true", "kernel": "inductor"}),)
AUTO = (("optimizer", {"compile": "auto"}),)


def regional(how: str, overrides: Tuple[Tuple[str, Any], ...] = (), **options: Any) -> Variant:
    """A Lightning variant under the ``regional`` policy; ``how`` says what else it changes."""
    return Variant("lightning", f"policy regional, {how}", "regional", overrides, **options)


VARIANTS = {
    "eager": Variant("raw", "none"),
    "torch_compile": Variant("raw", "torch.compile(model)"),
    "compile_regions": Variant("raw", "accelerate.utils.compile_regions(model)"),
    "block_compile": Variant("raw", "block.compile() for each block"),
    "policy_full": Variant("raw", "policy full", "full"),
    "policy_full_cudagraphs": Variant("raw", "policy reduce_overhead (full, CUDA graphs)", "reduce_overhead"),
    "policy_full_cpp_wrapper": Variant("raw", "policy full, Inductor C++ wrapper", "full", CPP_WRAPPER),
    "policy_full_background": Variant("raw", "policy full_background", "full_background"),
    "policy_regional": Variant("raw", "policy regional (CUDA graphs)", "regional"),
    "policy_regional_background": Variant("raw", "policy regional_background", "regional_background"),
    "policy_regional_no_cudagraphs": Variant("raw", "policy regional, default mode", "regional", NO_CUDA_GRAPHS),
    "policy_regional_no_cudagraphs_background": Variant(
        "raw", "policy regional_background, default mode", "regional_background", NO_CUDA_GRAPHS
    ),
    "policy_nested": Variant("raw", "policy regional_nested", "regional_nested"),
    "lightning_full": Variant("lightning", "policy full", "full"),
    "lightning_full_log_every_step": Variant(
        "lightning", "policy full, loss logged every step", "full", module=(("log_loss_every_step", True),)
    ),
    "lightning_full_cpp_wrapper": Variant("lightning", "policy full, Inductor C++ wrapper", "full", CPP_WRAPPER),
    "lightning_full_cudagraphs": Variant("lightning", "policy reduce_overhead", "reduce_overhead"),
    "lightning_full_background": Variant("lightning", "policy full_background", "full_background"),
    "lightning_regional": Variant("lightning", "policy regional (CUDA graphs)", "regional"),
    "lightning_regional_background": Variant("lightning", "policy regional_background", "regional_background"),
    # Lightning refuses gradient_clip_val with a fused AdamW under mixed precision ("performs unscaling of
    # gradients internally"; H100, lightning 2.6, 2026-11-23): a Lightning user who clips gets foreach.
    "lightning_regional_clip_foreach": regional(
        "foreach AdamW, gradient_clip_val=1.0", module=(("fused", False),), trainer=CLIP_TRAINER
    ),
    "lightning_regional_clip_compiled_optimizer": regional(
        "compiled optimizer step (Triton on CUDA; clipping inside), gradient_clip_val=1.0",
        COMPILED,
        trainer=CLIP_TRAINER,
    ),
    # What a Lightning user who wants fused AdamW and clipping writes instead: clip_grad_norm_ before the step.
    "lightning_regional_clip_fused_before_step": regional(
        "fused AdamW, clip_grad_norm_(1.0) before the step", step="clip"
    ),
    "lightning_regional_compiled_optimizer": regional(
        "compiled optimizer step (kernel auto: Triton on CUDA)", COMPILED
    ),
    "lightning_regional_compiled_optimizer_inductor": regional(
        "compiled optimizer step (Inductor over flat gradient buffers)", INDUCTOR
    ),
    "lightning_regional_clip_compiled_optimizer_inductor": regional(
        "compiled optimizer step (Inductor, clipping inside), gradient_clip_val=1.0", INDUCTOR, trainer=CLIP_TRAINER
    ),
    "lightning_regional_auto_optimizer": regional("optimizer compile: auto", AUTO),
    "lightning_regional_clip_auto_optimizer": regional(
        "optimizer compile: auto (clipping inside), gradient_clip_val=1.0", AUTO, trainer=CLIP_TRAINER
    ),
    # Forward and backward with no update: subtracted from the rows above, it leaves what the optimizer costs.
    "lightning_regional_backward_only": regional("forward and backward only (no optimizer update)", step="none"),
}


class GcRecorder:
    """Python's garbage collections in the timed window, per generation, and the host time they paused: lost
    throughput the per-step medians do not show."""

    def __init__(self):
        self.counts, self.pause_s, self._started = [0, 0, 0], 0.0, None

    def start(self) -> None:
        gc.callbacks.append(self._record)

    def stop(self) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.counts[info["generation"]] += 1
            self.pause_s += time.perf_counter() - self._started

    def result(self) -> Dict[str, Any]:
        return {"gc_collections": self.counts, "gc_pause_ms": self.pause_s * 1e3}


def make_batches(config: GPTConfig, batch_size: int, count: int) -> List[torch.Tensor]:
    """Real text (the standard library's source) as byte tokens: ``count`` batches of ``block_size + 1``."""
    needed = count * batch_size * (config.block_size + 1)
    data = b"".join(read_stdlib_bytes(needed))[:needed]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return list(tokens.view(count, batch_size, config.block_size + 1))


def policy_for(variant: str, backend: str):
    from compile_trainer.schema import to_policy

    return to_policy(VARIANTS[variant].policy, backend=backend, **dict(VARIANTS[variant].overrides))


def prepare_raw(variant: str, model: GPT, backend: str) -> Tuple[Callable[..., Any], Any, Any]:
    """Compile ``model`` as the variant says; return the callable the loop runs, the applied policy (None
    for the peers) and the background compile to poll at each step (None unless the variant has one)."""
    if variant == "torch_compile":
        return torch.compile(model, backend=backend), None, None
    if variant == "compile_regions":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend), None, None
    if variant == "block_compile":
        for block in model.blocks:
            block.compile(backend=backend)
    if VARIANTS[variant].policy:
        from torch import nn

        from compile_trainer.compiling.background import BackgroundCompile
        from compile_trainer.compiling.regions import apply_policy

        holder = nn.ModuleDict({"model": model})  # policies address modules as a LightningModule would
        policy = policy_for(variant, backend)
        applied = apply_policy(holder, policy)
        return model, applied, BackgroundCompile(applied) if policy.background else None
    return model, None, None


def make_module(variant: str, config: GPTConfig, device: torch.device) -> LanguageModel:
    torch.manual_seed(0)
    options = {"fused": device.type == "cuda"} | dict(VARIANTS[variant].module)
    return LanguageModel(model=asdict(config), lr=6e-4, warmup_steps=10, **options)


def measure_flops(model: GPT, batch: torch.Tensor, autocast: bool) -> int:
    return count_flops(model, lambda: model(batch[:, :-1], batch[:, 1:])[1], batch.device.type, autocast)


def run_raw(variant: str, args: argparse.Namespace, config: GPTConfig, device: torch.device) -> Dict[str, Any]:
    module = make_module(variant, config, device)
    model = module.model.to(device)
    batches = [b.to(device) for b in make_batches(config, args.batch_size, 8)]
    flops = measure_flops(model, batches[0], autocast=device.type == "cuda")
    optimizers = module.configure_optimizers()  # the same AdamW groups and schedule as under Lightning
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    run, applied, background = prepare_raw(variant, model, args.backend)
    train = common.training_step(
        optimizer, lambda batch: run(batch[:, :-1], batch[:, 1:])[1], device, applied, scheduler
    )
    losses: List[torch.Tensor] = []

    def step(index: int) -> None:
        if background is not None:
            background.poll()
        losses.append(train(batches[index % len(batches)]).clone())  # a CUDA-graph output is overwritten by a replay

    collections = GcRecorder()
    times = common.first_warm_timed(
        device, step, args.warmup, args.steps, lambda: background is not None and not background.installed,
        args.max_eager_steps, outer=[collections],
    )  # fmt: skip
    host_timer = common.HostTimer(device)
    for index in range(times["next_step"], times["next_step"] + args.host_steps + 1):
        host_timer.step_start()
        step(index)
    synchronize(device)
    result = finish(times, args, config, device, flops, losses) | {"host_ms": host_timer.median_ms()}
    return result | background_result(background) | collections.result()


def background_result(background: Any) -> Dict[str, Any]:
    if background is None:
        return {}
    return {"compiled_after_s": background.compiled_after_seconds, "eager_steps": background.eager_steps}


def optimizer_step_as(how: str):
    """A Lightning callback that changes what each optimizer's step runs: ``clip`` clips the gradients to total
    norm 1.0 with ``clip_grad_norm_`` before the step (Lightning refuses ``gradient_clip_val`` with fused AdamW
    under mixed precision), ``none`` runs Lightning's closure (forward, backward) and no update."""
    import lightning.pytorch as pl

    from compile_trainer import compat

    class OptimizerStepAs(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            for optimizer in trainer.optimizers:
                own_step = optimizer.step

                def step(closure=None, own_step=own_step, optimizer=optimizer):
                    loss = closure()
                    if how == "clip":
                        torch.nn.utils.clip_grad_norm_(pl_module.parameters(), 1.0)
                        own_step()
                    else:
                        compat.mark_optimizer_stepped(optimizer)  # the LR scheduler sees a step
                    return loss

                optimizer.step = step

    return OptimizerStepAs()


def run_lightning(variant: str, args: argparse.Namespace, config: GPTConfig, device: torch.device) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from compile_trainer.lightning.callback import CompileCallback

    class StepClock(pl.Callback):
        """``args.steps`` timed steps after ``args.warmup`` (counted from the first step that runs compiled), then
        the host time of ``args.host_steps`` steps; then stops the Trainer."""

        def __init__(self):
            self.timer, self.host_timer, self.collections = StepTimer(device), common.HostTimer(device), GcRecorder()
            self.started: Any = None
            self.first_step = self.window = 0.0
            self.timed_from: Optional[int] = None  # the first timed batch index
            self.losses: List[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            background = compile_callback.background
            if self.timed_from is None and (background is None or background.installed):
                self.timed_from = batch_idx + args.warmup
            if batch_idx == self.timed_from:
                self.collections.start()
            if batch_idx in (0, self.timed_from):
                synchronize(device)
                self.wall = time.perf_counter()
            timed = self.timed_from is not None and self.timed_from <= batch_idx < self.timed_from + args.steps
            self.started = self.timer.start() if timed else None
            if self.timed_from is not None and batch_idx >= self.timed_from + args.steps:
                self.host_timer.step_start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach())
            if self.started is not None:
                self.timer.stop(self.started)
            if batch_idx == 0:
                synchronize(device)
                self.first_step = time.perf_counter() - self.wall
            if self.timed_from is not None and batch_idx == self.timed_from + args.steps - 1:
                synchronize(device)
                self.window = time.perf_counter() - self.wall
                self.collections.stop()
            if self.timed_from is not None and batch_idx == self.timed_from + args.steps + args.host_steps:
                trainer.should_stop = True

    module = make_module(variant, config, device)
    batches = make_batches(config, args.batch_size, 8)
    flops = measure_flops(module.model.to(device), batches[0].to(device), device.type == "cuda")
    windows = [(b[:, :-1], b[:, 1:]) for b in batches]
    most_steps = args.warmup + args.steps + args.host_steps + 1 + args.max_eager_steps
    repeated = [pair for _ in range(math.ceil(most_steps / len(windows))) for pair in windows]
    loader = DataLoader(repeated, batch_size=None, shuffle=False, pin_memory=device.type == "cuda")
    compile_callback = CompileCallback(policy_for(variant, args.backend), print_plan=False)
    clock = StepClock()
    step_as = VARIANTS[variant].step
    trainer = common.quiet_trainer(
        device,
        max_steps=most_steps,
        log_every_n_steps=50,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        callbacks=[clock, compile_callback] + ([optimizer_step_as(step_as)] if step_as != "optimizer" else []),
        **dict(VARIANTS[variant].trainer),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=loader)
    seconds = clock.timer.seconds()
    times = {"step_s": statistics.median(seconds), "slowest_step_s": max(seconds), "window_s": clock.window}
    result = finish(times | {"first_step_s": clock.first_step}, args, config, device, flops, clock.losses)
    result |= {"host_ms": clock.host_timer.median_ms()} | clock.collections.result()
    choices = [step.choice.describe() for step in compile_callback.optimizer_steps if step.choice]
    return (
        result | background_result(compile_callback.background) | ({"optimizer_choice": choices[0]} if choices else {})
    )


def finish(times, args, config, device, flops, losses) -> Dict[str, Any]:
    from torch._dynamo.utils import calculate_time_spent, counters

    step_time, tokens, peak = times["step_s"], args.batch_size * config.block_size, common.peak_flops(device)
    return {
        "first_step_s": times["first_step_s"],
        "step_ms": step_time * 1e3,
        "slowest_step_ms": times["slowest_step_s"] * 1e3,
        "tokens_per_s": tokens * args.steps / times["window_s"],
        "tflops": flops / step_time / 1e12,
        "mfu": flops / step_time / peak if peak else None,
        "peak_mem_gib": common.peak_memory_gib(device),
        "graphs": counters["stats"]["unique_graphs"],
        "recompile_reasons": common.recompile_reasons(),
        "losses": [float(loss) for loss in losses[:5]],
        "compile_breakdown": {k: round(v, 2) for k, v in calculate_time_spent().items()},
    }


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    device = common.device_for(args.smoke)
    config = SMOKE if args.smoke else GPT2_SMALL
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    runner = run_raw if VARIANTS[args.variant].loop == "raw" else run_lightning
    return runner(args.variant, args, config, device)


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """One run per named variant; a variant named again is another run: ``variant#2``."""
    names = [
        f"{v}#{args.variants[:i].count(v) + 1}" if v in args.variants[:i] else v for i, v in enumerate(args.variants)
    ]
    return [
        {"variant": name, "loop": VARIANTS[v].loop, "compiled": VARIANTS[v].how, "_variant": v}
        for name, v in zip(names, args.variants)
    ]


def summarize(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    eager = next((row for row in rows if row["variant"] == "eager" and "losses" in row), None)
    for row in rows:
        if eager and "losses" in row:
            row["loss_rel_diff_vs_eager"] = common.rel_diff(row["losses"], eager["losses"])
    common.add_ratio(rows, "speedup_vs_eager", "tokens_per_s", lambda row: row["variant"] == "eager")
    for column, name in (("tokens_per_s", "throughput"), ("first_step_s", "first_step")):
        common.add_ratio(rows, f"{name}_vs_torch_compile", column, lambda row: row["variant"] == "torch_compile")
    return rows


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    block = (SMOKE if args.smoke else GPT2_SMALL).block_size
    repeats = f"; {args.repeats} fresh processes per variant, medians" if args.repeats > 1 else ""
    return [
        f"batch {args.batch_size} x {block} tokens, {args.steps} timed steps after {args.warmup}; backend "
        f"{args.backend}; fresh compile caches per variant{repeats}"
    ]


BENCHMARK = common.Benchmark(
    name="train_step",
    title="Training step: eager, torch.compile, peers and policies",
    columns="""variant loop first_step_s step_ms host_ms slowest_step_ms tokens_per_s speedup_vs_eager
    throughput_vs_torch_compile first_step_vs_torch_compile compiled_after_s eager_steps tflops mfu peak_mem_gib graphs
    gc_collections gc_pause_ms loss_rel_diff_vs_eager error""".split(),
    runs=runs,
    measure=measure,
    shared=dict(steps=200, warmup=5, backend="inductor", variant_timeout=300, repeats=1),
    options={
        "--variants": dict(nargs="+", default=list(VARIANTS), choices=list(VARIANTS)),
        "--batch-size": dict(type=int, default=8),
        "--max-eager-steps": dict(type=int, default=5000, help="background compile: most eager steps"),
        "--host-steps": dict(type=int, default=10, help="steps after the timed ones timing the host alone"),
    },
    smoke=dict(steps=3, warmup=2, batch_size=2, backend="aot_eager", host_steps=2),
    smoke_help="tiny model on the CPU with aot_eager",
    finish=summarize,
    notes=notes,
    timed=(
        "first_step_s",
        "step_ms",
        "host_ms",
        "slowest_step_ms",
        "tokens_per_s",
        "tflops",
        "mfu",
        "compiled_after_s",
    ),
    baseline="eager (speedup), torch_compile (throughput_vs_*, first_step_vs_*)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
