"""Variable sequence lengths: plain ``torch.compile`` vs ``mark_dynamic`` vs padding buckets, side by side.

60 training steps of GPT-2 small with 6 layers, batch 8, each batch of one length drawn uniformly from 64..1024
(seeded), bf16 autocast, fused AdamW; total time includes every compile, from empty Dynamo and Inductor caches.

    python benchmarks/dynamic_shapes.py --out benchmarks/results/dynamic_shapes.json               # GPU
    python benchmarks/dynamic_shapes.py --variants plain,dynamic,buckets,regional_dynamic,regional_buckets \\
        --out benchmarks/results/dynamic_shapes_regional.json                                        # GPU
    python benchmarks/dynamic_shapes.py --smoke --out /tmp/dynamic_shapes.json                        # CPU, tiny

Variants (the model compiled whole unless ``regional_``): ``plain`` (``torch.compile(model)``, automatic dynamic
shapes after a recompile), ``dynamic`` (the length marked dynamic first), ``buckets`` (``dynamic=False``, batches
padded to 128/256/512/1024), ``regional_dynamic`` / ``regional_buckets`` (the same as regional compile policies).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import synchronize  # noqa: E402
from benchmarks.models import GPT2_SMALL  # noqa: E402
from compile_trainer.compiling.regions import apply_policy  # noqa: E402
from compile_trainer.schema import CompilePolicy, DynamicDim, Padding, Rule, ShapesPolicy, validate_policy  # noqa: E402
from compile_trainer.shapes.batch import BatchShaper  # noqa: E402
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors  # noqa: E402
from recipes.data import TokenBatch  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402

GPT2_SMALL_6 = replace(GPT2_SMALL, n_layer=6)
SMOKE = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
VARIANTS = ["plain", "dynamic", "buckets", "regional_dynamic", "regional_buckets"]
COLUMNS = "variant total_s graphs recompiles compile_s steady_step_ms tokens_per_s padding speedup_vs_plain".split()


def length_stream(steps: int, low: int, high: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(steps)]


def make_batch(config: GPTConfig, batch_size: int, length: int, step: int, device: torch.device) -> TokenBatch:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, config.vocab_size, (batch_size, length + 1), generator=generator)
    return TokenBatch(tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))


def shapes_for(variant: str, buckets: List[int]) -> ShapesPolicy:
    if variant.endswith("dynamic"):
        return ShapesPolicy(dynamic=[DynamicDim("inputs", 1), DynamicDim("targets", 1)])
    if variant.endswith("buckets"):
        return ShapesPolicy(pad=Padding(dim=1, buckets=buckets, values={"inputs": 0, "targets": -100}))
    return ShapesPolicy()


def compiled_forward(variant: str, model: GPT, shaper: BatchShaper, backend: str, device: torch.device) -> Any:
    if variant == "plain" or variant == "dynamic":
        return torch.compile(model, backend=backend)
    if variant == "buckets":
        return torch.compile(model, backend=backend, dynamic=False)
    rules = [Rule(name="*", action="regional", rest="compile")]
    dynamic = False if variant == "regional_buckets" else None
    policy = validate_policy(
        CompilePolicy(name=variant, backend=backend, dynamic=dynamic, rules=rules, shapes=shaper.shapes)
    )
    applied = apply_policy(nn.ModuleDict({"model": model}), policy, device=device)
    RegionShapeInterceptors(applied, shaper)  # marks the regions' inputs like the batch
    return model


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    variant, config, device = args.variant, SMOKE if args.smoke else GPT2_SMALL_6, common.device_for(args.smoke)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=fused)
    shaper = BatchShaper(shapes_for(variant, args.buckets))
    forward = compiled_forward(variant, model, shaper, args.backend, device)
    train = common.training_step(optimizer, lambda batch: forward(batch.inputs, batch.targets)[1], device)
    lengths = length_stream(args.steps, args.min_length, args.max_length, args.seed)
    step_seconds, real_tokens, padded_tokens = [], 0, 0
    synchronize(device)
    started = time.perf_counter()
    for step, length in enumerate(lengths):
        step_started = time.perf_counter()
        batch = shaper(make_batch(config, args.batch_size, length, step, device))
        real_tokens += args.batch_size * length
        padded_tokens += batch.inputs.numel()
        loss = train(batch)
        synchronize(device)
        step_seconds.append(time.perf_counter() - step_started)
    total = time.perf_counter() - started
    metrics = list(torch._dynamo.utils.get_compilation_metrics())
    recompiles = [m for m in metrics if m.co_name and common.is_recompile(m)]
    steady = sorted(step_seconds)[: max(1, len(step_seconds) // 2)]  # the faster half: steps without compiles
    return {
        "variant": variant,
        "total_s": total,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "recompiles": len(recompiles),
        "compile_s": sum(common.frame_compile_seconds(m) for m in metrics),
        "steady_step_ms": 1e3 * statistics.median(steady),
        "tokens_per_s": real_tokens / total,
        "padding": padded_tokens / real_tokens - 1,
        "final_loss": loss.item(),
        "recompile_reasons": [str(getattr(m, "recompile_reason", "")) for m in recompiles][:10],
    }


def variant_list(text: str) -> List[str]:
    unknown = [v for v in text.split(",") if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    return text.split(",")


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    config = SMOKE if args.smoke else GPT2_SMALL_6
    return [
        f"{args.steps} steps, batch {args.batch_size}, lengths uniform in {args.min_length}..{args.max_length} "
        f"(seed {args.seed}), {config.n_layer} layers, d={config.n_embd}, vocab {config.vocab_size}, "
        f"backend {args.backend}, buckets {args.buckets}",
        "total_s: the whole stream, compiles included; steady_step_ms: median of the faster half of the steps; "
        "tokens_per_s: real (unpadded) tokens over total_s; padding: padded / real tokens - 1",
    ]


def speedup(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    common.add_ratio(rows, "speedup_vs_plain", "total_s", lambda row: row["variant"] == "plain", inverse=True)
    return rows


BENCHMARK = common.Benchmark(
    name="dynamic_shapes",
    title="Variable sequence lengths: plain vs dynamic vs buckets",
    columns=COLUMNS,
    runs=lambda args: [{"variant": variant} for variant in args.variants],
    measure=measure,
    shared=dict(steps=60, backend="inductor"),
    options={
        "--variants": dict(type=variant_list, default="plain,dynamic,buckets"),
        "--batch-size": dict(type=int, default=8),
        "--min-length": dict(type=int, default=64),
        "--max-length": dict(type=int, default=1024),
        "--buckets": dict(type=lambda text: [int(x) for x in text.split(",")], default=[128, 256, 512, 1024]),
        "--seed": dict(type=int, default=0),
    },
    smoke=dict(steps=6, batch_size=2, min_length=8, max_length=64, buckets=[32, 64], backend="aot_eager"),
    smoke_help="tiny model on the CPU (aot_eager), for CI",
    finish=speedup,
    notes=notes,
    in_process=True,
    baseline="plain",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__.splitlines()[0])
