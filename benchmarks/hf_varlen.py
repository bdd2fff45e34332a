"""Variable-length batches on a Hugging Face Llama: plain ``torch.compile`` vs the bundled shape policies.

``--steps`` batches of 8 rows, each of one length drawn uniformly from 64..1024 (seeded). ``real_models.py``'s
Llama, bf16 autocast, fused AdamW; each variant a fresh process with empty compile caches; total time counts every
compile and warm-up.

    python benchmarks/hf_varlen.py                       # GPU: every variant, benchmarks/results/hf_varlen.json
    python benchmarks/hf_varlen.py --smoke --out /tmp/x  # CPU, tiny model, aot_eager

Variants: ``plain`` (``torch.compile(model)``), the bundled policies ``dynamic``, ``dynamic_full`` (one dynamic
graph, lengths padded to multiples of 64), ``dynamic_full_background`` (compiled on a thread while the first steps
run eagerly), ``buckets`` (128/256/512/1024, every bucket compiled first), ``buckets_auto`` (4 buckets from the first
64 batches' lengths), and ``fixed_length`` (the same real tokens in full rows, ``torch.compile``: the reference).
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import synchronize  # noqa: E402
from benchmarks.models import build_model  # noqa: E402
from compile_trainer import compat  # noqa: E402
from compile_trainer.compiling.background import BackgroundCompile  # noqa: E402
from compile_trainer.compiling.regions import apply_policy  # noqa: E402
from compile_trainer.schema import to_policy  # noqa: E402
from compile_trainer.shapes.batch import BatchShaper  # noqa: E402
from compile_trainer.shapes.bucket_warmup import BucketWarmup  # noqa: E402
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors  # noqa: E402
from compile_trainer.telemetry.compile_events import WARMUP_PHASE, CompileTelemetry  # noqa: E402

VARIANTS = ["plain", "dynamic", "dynamic_full", "dynamic_full_background", "buckets", "buckets_auto", "fixed_length"]
FIXED_BUCKETS = [128, 256, 512, 1024]
COLUMNS = [
    "variant", "first_step_s", "total_s", "vs_plain_total", "vs_plain_total_at_most", "compile_s", "warmup_s",
    "steady_real_tokens_per_s", "vs_fixed_length", "synced_steady_real_tokens_per_s", "steady_compiles", "graphs",
    "recompiles_after_warmup", "padding", "buckets",
]  # fmt: skip


def stream(args: argparse.Namespace, vocab: int) -> List[Dict[str, torch.Tensor]]:
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.steps):
        length = rng.randint(args.min_length, args.max_length)
        ids = torch.randint(1, vocab, (args.batch_size, length), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return batches


def packed(batches: List[Dict[str, torch.Tensor]], args: argparse.Namespace) -> List[Dict[str, torch.Tensor]]:
    """The same real tokens in full rows of ``max_length``: the fixed-length reference."""
    tokens = torch.cat([b["input_ids"][b["attention_mask"] == 1] for b in batches])
    per_batch = args.batch_size * args.max_length
    count = math.ceil(tokens.numel() / per_batch)
    tokens = torch.cat([tokens, tokens[: count * per_batch - tokens.numel()]]).view(count, args.batch_size, -1)
    return [{"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()} for t in tokens]


def variant_policy(variant: str) -> Tuple[str, Dict[str, str]]:
    """A variant's bundled policy and its overrides: ``dynamic@rest=outer@mode=reduce-overhead`` replaces every
    rule's ``rest`` (or ``@action``) and the policy's ``mode``; ``@lowering=thread`` its ``background_lowering``;
    ``@pad=64`` pads lengths to multiples of 64 (ids 0, labels -100, the mask ``@mask_pad``, default 0; 1 keeps a
    causal model's mask all ones)."""
    name, overrides = common.split_variant(variant)
    unknown = set(overrides) - {"action", "rest", "mode", "pad", "mask_pad", "lowering"}
    if name not in VARIANTS or unknown:
        raise argparse.ArgumentTypeError(
            f"variant {variant!r}: one of {VARIANTS}, then @action=..., @rest=..., @mode=..., @lowering=..., "
            "@pad=N, @mask_pad=0|1"
        )
    return name, overrides


def run_variant(variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    model, _, vocab = build_model("llama", args.smoke)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    batches = stream(args, vocab)
    name, changes = variant_policy(variant)
    if name == "fixed_length":
        batches = packed(batches, args)
    shaper, forward, policy, applied, background = None, model, None, None, None
    if name in ("plain", "fixed_length"):
        forward = torch.compile(model, backend=args.backend)
    else:
        overrides = {"backend": args.backend}
        if name == "buckets":
            overrides["shapes"] = {"pad": {"buckets": [b * args.max_length // 1024 for b in FIXED_BUCKETS]}}
        if name == "buckets_auto":
            overrides["shapes"] = {"pad": {"max": args.max_length}}
        if "lowering" in changes:
            overrides["background_lowering"] = changes["lowering"]
        if "mode" in changes:
            overrides["mode"] = None if changes["mode"] == "null" else changes["mode"]
        if "pad" in changes:
            values = {"@tokens": 0, "@attention_mask": int(changes.get("mask_pad", 0)), "@labels": -100}
            overrides["shapes"] = {"pad": {"dim": 1, "multiple_of": int(changes["pad"]), "values": values}}
        policy = to_policy(name, **overrides)
        if changes.keys() & {"action", "rest"}:
            policy = common.with_rule_changes(policy, **{k: changes[k] for k in ("action", "rest") if k in changes})
        holder = nn.ModuleDict({"model": model})  # as in a LightningModule, so the bundled rules (name: "*") match
        applied = apply_policy(holder, policy, device=device)
        shaper = BatchShaper(policy.shapes)
        RegionShapeInterceptors(applied, shaper)
        if policy.background:  # as CompileCallback does: eager steps until the thread's compile is installed
            background = BackgroundCompile(applied)
    train_step = common.training_step(optimizer, lambda batch: forward(**batch).loss, device, applied)

    telemetry = CompileTelemetry(applied).install()  # its callbacks see every compile, lazy backwards included

    synchronize(device)
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
            warm_started, telemetry.phase = time.perf_counter(), WARMUP_PHASE  # its compiles are not recompiles
            warmup.replay()
            synchronize(device)
            warmup_s += time.perf_counter() - warm_started
            telemetry.phase = "train"
        if shaper is not None:
            batch = shaper(batch)
            if warmup is not None:
                sample = shaper.length_of(batch)
                warmup.length, warmup.batch_size = sample.length, sample.rows
        positions += batch["input_ids"].numel()
        eager = background is not None and not background.installed and not background.poll()
        if eager:
            eager_lengths[int(batch["input_ids"].shape[1])] += 1
        before, step_started = telemetry.compile_count, time.perf_counter()
        train_step(batch)
        synchronize(device)
        seconds = time.perf_counter() - step_started
        length = int(batch["input_ids"].shape[1])
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
    metrics = list(compat.compilation_metrics())
    recompiles = [m for m in metrics if common.is_recompile(m)]
    return {
        "variant": variant,
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
        "dynamo_metrics_recorded": len(metrics),
        "padding": positions / real - 1,
        "buckets": shaper.buckets if shaper is not None else None,
        "recompile_reasons": [str(getattr(m, "recompile_reason", "")) for m in recompiles][:10],
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
    synchronize(device)


def steady_pass(batches, shaper, train_step, device) -> float:
    """Real tokens/s over ``batches`` (each at a length already compiled and, with CUDA graphs, recorded) as a fit
    runs them: no sync between steps, so the host queues a step while the GPU runs the last (the timed stream syncs
    after every step to time it alone, which leaves the GPU idle between steps), and pinned batches, as a
    DataLoader with ``pin_memory=True`` hands them over (a copy from pageable memory waits for the queued work)."""
    if device.type == "cuda":
        batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        train_step(shaper(batch) if shaper is not None else batch)
    synchronize(device)
    return tokens / (time.perf_counter() - started)


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Against plain's total (or, where plain timed out, the seconds it ran) and fixed_length's steady tokens/s."""
    common.add_ratio(rows, "vs_plain_total", "total_s", lambda row: row["variant"] == "plain")
    plain_ran_s = next((row["ran_s"] for row in rows if row["variant"] == "plain" and "ran_s" in row), None)
    for row in rows:
        if plain_ran_s and "total_s" in row and "vs_plain_total" not in row:
            row["vs_plain_total_at_most"] = row["total_s"] / plain_ran_s
    common.add_ratio(rows, "vs_fixed_length", "steady_real_tokens_per_s", lambda row: row["variant"] == "fixed_length")


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    return [{"variant": v} | ({"_timeout": args.plain_timeout} if v == "plain" else {}) for v in args.variants]


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    with common.fresh_compiler_state():
        return run_variant(args.variant, args)


def finish(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    for row in rows:  # a variant that timed out: the seconds it ran, for vs_plain_total_at_most
        if row.get("error", "").startswith("timed out"):
            timeout = args.plain_timeout if row["variant"] == "plain" and args.plain_timeout else args.variant_timeout
            row.update(error=f"did not finish within {timeout} s", ran_s=timeout)
    add_ratios(rows)
    return rows


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    return [
        f"{args.steps} steps, batch {args.batch_size}, batch lengths uniform in {args.min_length}..{args.max_length} "
        f"(seed {args.seed}), every row of a batch of its length; HF Llama (16 layers, d 1024, vocab 32000), bf16 "
        "autocast, fused AdamW; each variant in a fresh process with empty caches",
        "total_s: the whole stream, compiles and warm-up included; vs_plain_total: total_s / plain's; "
        "steady_real_tokens_per_s: the stream run again after it (every length compiled; with CUDA graphs the "
        "batches at lengths recorded, that is seen twice), pinned, without a sync between steps: real (unmasked) "
        "tokens / seconds; synced_steady_real_tokens_per_s: in the timed stream, the steps that compiled and recorded "
        "nothing (a sync after each); padding: positions / real tokens - 1; recompiles_after_warmup: a frame's "
        "compiles after its first, bucket warm-up's aside; vs_plain_total_at_most: total_s / the seconds plain ran "
        "before its timeout stopped it",
        "fixed_length: the same real tokens packed into full rows of the longest length, torch.compile(model)",
        "*_background: total_s ends with the stream, whether or not the compile was installed by then; a length the "
        "stream ran only eagerly runs compiled (untimed) as often as the stream's compiled steps did before the "
        "steady pass (once; twice with CUDA graphs: warm-up, recording)",
    ]


def checked_variant(variant: str) -> str:
    variant_policy(variant)
    return variant


BENCHMARK = common.Benchmark(
    name="hf_varlen",
    title="Variable-length batches on HF Llama: plain torch.compile vs dynamic vs buckets",
    columns=COLUMNS,
    runs=runs,
    measure=measure,
    shared=dict(steps=200, backend="inductor", variant_timeout=240),
    in_process=lambda args: args.smoke,  # the CPU smoke: one process (the GPU's variants each a fresh one)
    options={
        "--variants": dict(nargs="+", default=VARIANTS, type=checked_variant, help="a policy's with @key=value"),
        "--batch-size": dict(type=int, default=8),
        "--min-length": dict(type=int, default=64),
        "--max-length": dict(type=int, default=1024),
        "--seed": dict(type=int, default=0),
        "--plain-timeout": dict(type=int, help="seconds for plain (default: --variant-timeout)"),
    },
    smoke=dict(steps=8, batch_size=2, min_length=8, max_length=64, backend="aot_eager"),
    smoke_help="tiny Llama on the CPU, aot_eager, 8 steps",
    finish=finish,
    notes=notes,
    baseline="plain (vs_plain_total), fixed_length (vs_fixed_length)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__.splitlines()[0])
