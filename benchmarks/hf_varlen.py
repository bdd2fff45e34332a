"""Variable-length batches on a Hugging Face Llama: plain ``torch.compile`` vs the bundled shape policies.

``--steps`` batches of 8 rows, each of one length drawn uniformly from 64..1024 (seeded). ``real_models.py``'s
Llama, bf16 autocast, fused AdamW; each variant a fresh process with empty compile caches; total time counts every
compile and warm-up.

    python benchmarks/hf_varlen.py --seed 0 --variants fixed_length dynamic_full dynamic_full_background
    python benchmarks/hf_varlen.py --seed 0 --pad-multiple 16 --variants fixed_length dynamic_full
    python benchmarks/hf_varlen.py --smoke --out /tmp/x  # CPU, tiny model, aot_eager

Variants: ``plain`` (``torch.compile(model)``), the bundled policies ``dynamic``, ``dynamic_full`` (one dynamic
graph, lengths padded to multiples of 64), ``dynamic_full_background`` (compiled on a thread while the first steps
run eagerly), ``buckets_auto`` (4 buckets from the first 64 batches' lengths), and ``fixed_length`` (the same real
tokens in full rows, ``torch.compile``: the reference).
"""

import argparse
import collections
import gc
import math
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer import apply_policy, compat, to_policy  # noqa: E402
from compile_trainer.compiling.background import BackgroundCompile  # noqa: E402
from compile_trainer.optimizer import compile_optimizer  # noqa: E402
from compile_trainer.shapes.batch import BatchShaper  # noqa: E402
from compile_trainer.shapes.bucket_warmup import BucketWarmup  # noqa: E402
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors  # noqa: E402
from compile_trainer.telemetry.compile_events import WARMUP_PHASE, CompileTelemetry  # noqa: E402

OPTIMIZERS = {"fused": "fused AdamW", "compiled": "AdamW with compile_optimizer's step (every variant)"}
VARIANTS = ["plain", "dynamic", "dynamic_full", "dynamic_full_background", "buckets_auto", "fixed_length"]
COLUMNS = [
    "variant", "first_step_s", "total_s", "vs_plain_total", "compile_s", "warmup_s", "steady_real_tokens_per_s",
    "vs_fixed_length", "synced_steady_real_tokens_per_s", "steady_compiles", "graphs", "recompiles_after_warmup",
    "padding", "buckets",
]  # fmt: skip


def stream(args: argparse.Namespace, vocab: int) -> List[Dict[str, torch.Tensor]]:
    """``--steps`` batches of random tokens, each of one length drawn uniformly (both seeded by ``--seed``)."""
    rng, generator = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    lengths = [rng.randint(args.min_length, args.max_length) for _ in range(args.steps)]
    ids = [torch.randint(1, vocab, (args.batch_size, length), generator=generator) for length in lengths]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def packed(batches: List[Dict[str, torch.Tensor]], args: argparse.Namespace) -> List[Dict[str, torch.Tensor]]:
    """The same real tokens in full rows of ``max_length``: the fixed-length reference."""
    tokens = torch.cat([b["input_ids"][b["attention_mask"] == 1] for b in batches])
    per_batch = args.batch_size * args.max_length
    count = math.ceil(tokens.numel() / per_batch)
    tokens = torch.cat([tokens, tokens[: count * per_batch - tokens.numel()]]).view(count, args.batch_size, -1)
    return [{"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()} for t in tokens]


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """The stream under ``args.variant`` (timed step by step, compiles included), then its steady pass."""
    device = common.device_for(args.smoke)
    torch.manual_seed(0)
    model, _, vocab = models.build_model("llama", args.smoke)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    if args.optimizer == "compiled":  # every variant, the reference included: the library's step (Triton on CUDA)
        compile_optimizer(optimizer, {"compile": "true"}, backend=args.backend)
    batches = stream(args, vocab)
    if args.variant in ("plain", "fixed_length"):
        batches = packed(batches, args) if args.variant == "fixed_length" else batches
        forward, policy, applied, shaper = torch.compile(model, backend=args.backend), None, None, None
    else:
        pad = {"max": args.max_length} if args.variant == "buckets_auto" else {}
        if args.pad_multiple is not None:
            pad["multiple_of"] = args.pad_multiple
        policy, forward = to_policy(args.variant, backend=args.backend, shapes={"pad": pad}), model
        # the bundled rules (name: "*") match the model as in a LightningModule
        applied = apply_policy(nn.ModuleDict({"model": model}), policy, device=device)
        shaper = BatchShaper(policy.shapes)
        RegionShapeInterceptors(applied, shaper)
    train_step = common.training_step(optimizer, lambda batch: forward(**batch).loss, device, applied)
    row = run_stream(args, batches, policy, applied, shaper, train_step, device)
    if args.optimizer == "compiled":  # its first step runs the optimizer's own (the state does not exist yet)
        row["optimizer_steps"] = {"compiled": optimizer.step.compiled_steps, "own": optimizer.step.eager_steps}
    return row


def run_stream(args, batches, policy, applied, shaper, train_step, device) -> Dict[str, Any]:
    """The timed stream with what CompileCallback does around it (bucket choice and warm-up; eager steps until a
    background compile is installed), then the steady pass; the row."""
    background = BackgroundCompile(applied) if applied is not None and applied.defers_compiles else None
    telemetry = CompileTelemetry(applied).install()  # its callbacks see every compile, lazy backwards included
    common.synchronize(device)
    started = time.perf_counter()
    warmup_s = 0.0
    if shaper is not None and policy.shapes.pad.auto is not None:
        shaper.choose_buckets([shaper.length_of(b) for b in batches[: policy.shapes.pad.auto.sample_batches]])
    # What CompileCallback's warm-up does: the region calls that compiled in a step are compiled at every other
    # bucket (traced, not run) before the next step
    warmup = None
    if shaper is not None and policy.shapes.warmup:
        warmup = BucketWarmup(applied, lambda: shaper.buckets or [], policy.shapes.pad.dim)
    steady_tokens, steady_s, real, positions = 0, 0.0, 0, 0
    step_ms, occurrences = [], collections.Counter()  # (length the model saw, first time it saw it, ms) per step
    eager_lengths = collections.Counter()  # a background compile's eager steps, per length
    cuda_graphs = policy is not None and "reduce-overhead" in (policy.mode, *(rule.mode for rule in policy.rules))
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        real += int(batch["attention_mask"].sum())
        if warmup is not None and warmup.pending:
            telemetry.phase = WARMUP_PHASE  # its compiles are not recompiles
            warmup_s += common.timed(device, warmup.replay)
            telemetry.phase = "train"
        if shaper is not None:
            batch = shaper(batch)
            if warmup is not None:
                sample = shaper.length_of(batch)
                warmup.length, warmup.batch_size = sample.length, sample.rows
        length = int(batch["input_ids"].shape[1])
        positions += batch["input_ids"].numel()
        eager = background is not None and not background.installed and not background.poll()
        eager_lengths[length] += eager
        before = telemetry.compile_count
        seconds = common.timed(device, partial(train_step, batch))
        step_ms.append([length, occurrences[length] == 0, round(seconds * 1e3, 2)])
        # CUDA graph trees run a new shape once to warm up and record it at its second run
        recording = cuda_graphs and occurrences[length] < 2
        occurrences[length] += 1
        if telemetry.compile_count == before and not recording and not eager:
            steady_tokens += int(batch["attention_mask"].sum())
            steady_s += seconds
    total = time.perf_counter() - started
    if background is not None:
        background.close()
        warm_after_background(batches, step_ms, eager_lengths, 2 if cuda_graphs else 1, shaper, train_step, device)
    again = [b for b, (length, *_) in zip(batches, step_ms) if not cuda_graphs or occurrences[length] >= 2]
    before = telemetry.compile_count
    steady_tokens_per_s = steady_pass(again, shaper, train_step, device)
    telemetry.collect()
    telemetry.uninstall()
    return {
        "variant": args.variant,
        "first_step_s": step_ms[0][2] / 1e3,
        "total_s": total,
        "background": background.summary() if background is not None else None,
        "compile_s": telemetry.compile_time_s,
        "warmup_s": warmup_s,
        "steady_real_tokens_per_s": steady_tokens_per_s,
        "steady_steps": len(again),
        "steady_compiles": telemetry.compile_count - before,  # 0: nothing compiled in the steady pass
        "synced_steady_real_tokens_per_s": steady_tokens / steady_s if steady_s else None,
        "graphs": compat.unique_graphs(),
        # a frame's compiles after its first, bucket warm-up's aside
        "recompiles_after_warmup": telemetry.totals()["recompiles"],
        "dynamo_metrics_recorded": len(compat.compilation_metrics()),
        "padding": positions / real - 1,
        "buckets": shaper.buckets if shaper is not None else None,
        "recompile_reasons": common.recompile_reasons(limit=10),
        "steps": len(batches),
        "real_tokens": real,
        "step_ms": step_ms,
    }


def warm_after_background(batches, step_ms, eager_lengths, runs, shaper, train_step, device) -> None:
    """Untimed: each length that the stream ran only eagerly (its background compile not yet installed) runs
    ``runs`` times compiled (CUDA graphs warm up, then record), as the stream's compiled steps did for theirs;
    else the steady pass would time those warm-ups and recordings."""
    first = {}
    for batch, (length, *_) in zip(batches, step_ms):
        first.setdefault(length, batch)
    ran = collections.Counter(length for length, *_ in step_ms)
    for length, batch in first.items():
        for _ in range(max(0, runs - (ran[length] - eager_lengths[length]))):
            batch = {k: v.to(device) for k, v in batch.items()}
            train_step(shaper(batch) if shaper is not None else batch)
    common.synchronize(device)


def steady_pass(batches, shaper, train_step, device) -> float:
    """Real tokens/s over ``batches`` (each at a length already compiled and, with CUDA graphs, recorded) as a fit
    runs them: no sync between steps, so the host queues a step while the GPU runs the last (the timed stream syncs
    after every step to time it alone, which leaves the GPU idle between steps), and pinned batches, as a
    DataLoader with ``pin_memory=True`` hands them over (a copy from pageable memory waits for the queued work).
    After a full garbage collection, as ``common.first_warm_timed``'s window: the one a compile's objects trigger
    later is a one-time pause, not the steady state."""
    gc.collect()
    if device.type == "cuda":
        batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    def run() -> None:
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            train_step(shaper(batch) if shaper is not None else batch)

    return tokens / common.timed(device, run)


def add_ratios(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Against plain's total and fixed_length's steady tokens/s."""
    common.add_ratio(rows, "vs_plain_total", "total_s", lambda row: row["variant"] == "plain")
    is_fixed_length = lambda row: row["variant"] == "fixed_length"  # noqa: E731
    return common.add_ratio(rows, "vs_fixed_length", "steady_real_tokens_per_s", is_fixed_length)


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    return [
        f"{args.steps} steps, batch {args.batch_size}, batch lengths uniform in {args.min_length}..{args.max_length} "
        f"(seed {args.seed}), every row of a batch of its length; HF Llama (16 layers, d 1024, vocab 32000), bf16 "
        f"autocast, {OPTIMIZERS[args.optimizer]}; each variant in a fresh process with empty caches",
        "total_s: the whole stream, compiles and warm-up included; vs_plain_total: total_s / plain's; "
        "steady_real_tokens_per_s: the stream run again after it (every length compiled; with CUDA graphs the "
        "batches at lengths recorded, that is seen twice), pinned, without a sync between steps, after a full "
        "garbage collection: real (unmasked) tokens / seconds; synced_steady_real_tokens_per_s: in the timed "
        "stream, the steps that compiled and recorded nothing (a sync after each); padding: positions / real "
        "tokens - 1; recompiles_after_warmup: a frame's "
        "compiles after its first, bucket warm-up's aside",
        *(
            [f"the policies' lengths padded to multiples of {args.pad_multiple} (--pad-multiple)"]
            if args.pad_multiple
            else []
        ),
        "fixed_length: the same real tokens packed into full rows of the longest length, torch.compile(model)",
        "*_background: total_s ends with the stream, whether or not the compile was installed by then; a length the "
        "stream ran only eagerly runs compiled (untimed) as often as the stream's compiled steps did before the "
        "steady pass (once; twice with CUDA graphs: warm-up, recording)",
    ]


BENCHMARK = common.Benchmark(
    name="hf_varlen",
    title="Variable-length batches on HF Llama: plain torch.compile vs dynamic vs buckets",
    columns=COLUMNS,
    runs=lambda args: [{"variant": variant} for variant in args.variants],
    measure=measure,
    shared=dict(steps=200, backend="inductor", variant_timeout=240),
    in_process=lambda args: args.smoke,  # the CPU smoke: one process (the GPU's variants each a fresh one)
    options={
        "--variants": dict(nargs="+", default=VARIANTS, choices=VARIANTS),
        "--batch-size": dict(type=int, default=8),
        "--min-length": dict(type=int, default=64),
        "--max-length": dict(type=int, default=1024),
        "--seed": dict(type=int, default=0),
        # the policies' shapes.pad.multiple_of (dynamic_full's own: 64); fixed_length and plain pad nothing
        "--pad-multiple": dict(type=int, default=None),
        # fused: torch's fused AdamW; compiled: compile_optimizer's step (a fixed cost per step that short steps
        # pay more often per token)
        "--optimizer": dict(default="fused", choices=["fused", "compiled"]),
    },
    smoke=dict(steps=8, batch_size=2, min_length=8, max_length=64, backend="aot_eager"),
    finish=add_ratios,
    notes=notes,
    baseline="plain (vs_plain_total), fixed_length (vs_fixed_length)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
