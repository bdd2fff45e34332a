"""Training-step benchmark: eager vs torch.compile vs the peers vs this project's policies, in a raw loop and in
Lightning, side by side; each variant a fresh process with empty compile caches. GPT-2 small, bf16 autocast, fused
AdamW, batch 8 x 1024 (GPU):

    python benchmarks/train_step.py --out benchmarks/results/train_step.json
    python benchmarks/train_step.py --smoke --out /tmp/train_step.json   # CPU, tiny model, aot_eager
"""

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch._dynamo.utils import calculate_time_spent
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer import CompileCallback, apply_policy, to_policy  # noqa: E402
from compile_trainer.compiling.background import BackgroundCompile  # noqa: E402
from compile_trainer_recipes.data import read_stdlib_bytes  # noqa: E402
from compile_trainer_recipes.gpt import GPT, GPTConfig, LanguageModel  # noqa: E402

SMOKE = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)

VARIANTS = {  # name: the loop (raw PyTorch or Lightning), how it compiles, the bundled policy
    "eager": ("raw", "none", None),
    "torch_compile": ("raw", "torch.compile(model)", None),
    "compile_regions": ("raw", "accelerate.utils.compile_regions(model)", None),
    "block_compile": ("raw", "block.compile() for each block", None),
    "policy_full": ("raw", "policy full", "full"),
    "policy_regional": ("raw", "policy regional (CUDA graphs)", "regional"),
    "policy_regional_background": ("raw", "policy regional_background", "regional_background"),
    "lightning_full": ("lightning", "policy full", "full"),
    "lightning_regional": ("lightning", "policy regional (CUDA graphs)", "regional"),
    "lightning_regional_background": ("lightning", "policy regional_background", "regional_background"),
}


def setup(args: argparse.Namespace, config: GPTConfig, device: torch.device):
    """The recipe's module (seeded: the same weights, AdamW groups and schedule in both loops), 8 batches of real
    text (the standard library's source as byte tokens) and the FLOPs of a training step."""
    needed = 8 * args.batch_size * (config.block_size + 1)
    data = b"".join(read_stdlib_bytes(needed))[:needed]
    batches = list(torch.frombuffer(bytearray(data), dtype=torch.uint8).long().view(8, args.batch_size, -1))
    torch.manual_seed(0)
    module = LanguageModel(model=asdict(config), lr=6e-4, warmup_steps=10, fused=device.type == "cuda").to(device)
    first = batches[0].to(device)
    flops = models.count_flops(module.model, lambda: module.model(first[:, :-1], first[:, 1:])[1], device)
    return module, batches, flops


def prepare_raw(variant: str, model: GPT, backend: str):
    """Compile ``model`` as the variant says; return the callable the loop runs, the applied policy (None for the
    peers) and the background compile to poll at each step (None unless the policy has one)."""
    if variant == "torch_compile":
        return torch.compile(model, backend=backend), None, None
    if variant == "compile_regions":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend), None, None
    if variant == "block_compile":
        for block in model.blocks:
            block.compile(backend=backend)
    if VARIANTS[variant][2] is None:
        return model, None, None
    policy = to_policy(VARIANTS[variant][2], backend=backend)
    applied = apply_policy(nn.ModuleDict({"model": model}), policy)  # addressed as in a LightningModule
    return model, applied, BackgroundCompile(applied) if applied.defers_compiles else None


def run_raw(variant: str, args: argparse.Namespace, config: GPTConfig, device: torch.device) -> Dict[str, Any]:
    module, batches, flops = setup(args, config, device)
    model, batches = module.model, [b.to(device) for b in batches]
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    run, applied, background = prepare_raw(variant, model, args.backend)
    loss_of = lambda batch: run(batch[:, :-1], batch[:, 1:])[1]  # noqa: E731
    train = common.training_step(optimizer, loss_of, device, applied, scheduler)
    losses: List[torch.Tensor] = []

    def step(index: int) -> None:
        if background is not None:
            background.poll()
        losses.append(train(batches[index % len(batches)]).clone())  # a CUDA-graph output is overwritten by a replay

    compiling = lambda: background is not None and not background.installed  # noqa: E731
    times = common.first_warm_timed(device, step, args.warmup, args.steps, compiling, args.max_eager_steps)
    return finish(times, args, config, device, flops, losses, background)


def run_lightning(variant: str, args: argparse.Namespace, config: GPTConfig, device: torch.device) -> Dict[str, Any]:
    class StepClock(pl.Callback):
        """``args.steps`` timed steps after ``args.warmup`` (counted from the first step that runs compiled), then
        stops the Trainer."""

        def __init__(self):
            self.timer, self.started = common.StepTimer(device), None
            self.wall = self.first_step = self.window = 0.0
            self.timed_from: Optional[int] = None  # the first timed batch index
            self.losses: List[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            background = compile_callback.background
            if self.timed_from is None and (background is None or background.installed):
                self.timed_from = batch_idx + args.warmup
            if batch_idx in (0, self.timed_from):
                common.synchronize(device)
                self.wall = time.perf_counter()
            timed = self.timed_from is not None and self.timed_from <= batch_idx < self.timed_from + args.steps
            self.started = self.timer.start() if timed else None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach())
            if self.started is not None:
                self.timer.stop(self.started)
            if batch_idx == 0:
                common.synchronize(device)
                self.first_step = time.perf_counter() - self.wall
            if self.timed_from is not None and batch_idx == self.timed_from + args.steps - 1:
                common.synchronize(device)
                self.window = time.perf_counter() - self.wall
                trainer.should_stop = True

    module, batches, flops = setup(args, config, device)
    windows = [(b[:, :-1], b[:, 1:]) for b in batches]
    most_steps = args.warmup + args.steps + args.max_eager_steps
    repeated = [pair for _ in range(math.ceil(most_steps / len(windows))) for pair in windows]
    loader = DataLoader(repeated, batch_size=None, shuffle=False, pin_memory=device.type == "cuda")
    compile_callback = CompileCallback(to_policy(VARIANTS[variant][2], backend=args.backend), print_plan=False)
    clock = StepClock()
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    trainer = common.quiet_trainer(
        device, max_steps=most_steps, log_every_n_steps=50, precision=precision, callbacks=[clock, compile_callback]
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=loader)
    seconds = clock.timer.seconds()
    times = {"step_s": statistics.median(seconds), "slowest_step_s": max(seconds), "window_s": clock.window}
    times["first_step_s"] = clock.first_step
    return finish(times, args, config, device, flops, clock.losses, compile_callback.background)


def finish(times, args, config, device, flops, losses, background) -> Dict[str, Any]:
    """The row: times, throughput, compile counts and the first losses (against eager's in ``summarize``)."""
    row = common.timed_row(times, device, flops) | {
        "tokens_per_s": args.batch_size * config.block_size * args.steps / times["window_s"],
        "recompile_reasons": common.recompile_reasons(),
        "losses": [float(loss) for loss in losses[:5]],
        "compile_breakdown": {k: round(v, 2) for k, v in calculate_time_spent().items()},
    }
    if background is not None:
        row |= {"compiled_after_s": background.compiled_after_seconds, "eager_steps": background.eager_steps}
    return row


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    device = common.device_for(args.smoke)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    runner = run_raw if VARIANTS[args.variant][0] == "raw" else run_lightning
    return runner(args.variant, args, SMOKE if args.smoke else models.GPT2_SMALL, device)


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """One run per named variant; a variant named again is another run: ``variant#2``."""
    planned = []
    for i, v in enumerate(args.variants):
        name = f"{v}#{args.variants[:i].count(v) + 1}" if v in args.variants[:i] else v
        planned.append({"variant": name, "loop": VARIANTS[v][0], "compiled": VARIANTS[v][1], "_variant": v})
    return planned


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
    block = (SMOKE if args.smoke else models.GPT2_SMALL).block_size
    repeats = f"; {args.repeats} fresh processes per variant, medians" if args.repeats > 1 else ""
    return [
        f"batch {args.batch_size} x {block} tokens, {args.steps} timed steps after {args.warmup} and a full garbage "
        f"collection; backend "
        f"{args.backend}; fresh compile caches per variant{repeats}"
    ]


BENCHMARK = common.Benchmark(
    name="train_step",
    title="Training step: eager, torch.compile, peers and policies",
    columns="""variant loop first_step_s step_ms slowest_step_ms tokens_per_s speedup_vs_eager
    throughput_vs_torch_compile first_step_vs_torch_compile compiled_after_s eager_steps tflops mfu peak_mem_gib graphs
    loss_rel_diff_vs_eager error""".split(),
    runs=runs,
    measure=measure,
    shared=dict(steps=200, warmup=5, backend="inductor", variant_timeout=300, repeats=1),
    options={
        "--variants": dict(nargs="+", default=list(VARIANTS), choices=list(VARIANTS)),
        "--batch-size": dict(type=int, default=8),
        "--max-eager-steps": dict(type=int, default=5000, help="background compile: most eager steps"),
    },
    smoke=dict(steps=3, warmup=2, batch_size=2, backend="aot_eager"),
    finish=summarize,
    notes=notes,
    timed=tuple("first_step_s step_ms slowest_step_ms tokens_per_s tflops mfu compiled_after_s".split()),
    baseline="eager (speedup), torch_compile (throughput_vs_*, first_step_vs_*)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
