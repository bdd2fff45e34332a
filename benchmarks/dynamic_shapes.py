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
from compile_trainer import compat  # noqa: E402
from compile_trainer.compiling.regions import apply_policy  # noqa: E402
from compile_trainer.schema import CompilePolicy, DynamicDim, Padding, Rule, ShapesPolicy, validate_policy  # noqa: E402
from compile_trainer.shapes.batch import BatchShaper  # noqa: E402
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors  # noqa: E402
from recipes.data import TokenBatch  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402

GPT2_SMALL_6 = replace(GPT2_SMALL, n_layer=6)
SMOKE = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
VARIANTS = ["plain", "dynamic", "buckets", "regional_dynamic", "regional_buckets"]
COLUMNS = ["variant", "total_s", "graphs", "recompiles", "compile_s", "steady_step_ms", "tokens_per_s", "padding"]


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


def run_variant(variant: str, args: argparse.Namespace, config: GPTConfig, device: torch.device) -> Dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(config).to(device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=fused)
    shaper = BatchShaper(shapes_for(variant, args.buckets))
    forward = compiled_forward(variant, model, shaper, args.backend, device)
    train = common.training_step(optimizer, lambda batch: forward(batch.inputs, batch.targets)[1], device)
    lengths = length_stream(args.steps, args.min_length, args.max_length, args.seed)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.utils.clear_compilation_metrics()
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
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
        "recompiles": len(recompiles),
        "compile_s": sum(common.frame_compile_seconds(m) for m in metrics),
        "steady_step_ms": 1e3 * statistics.median(steady),
        "tokens_per_s": real_tokens / total,
        "padding": padded_tokens / real_tokens - 1,
        "final_loss": loss.item(),
        "recompile_reasons": [str(getattr(m, "recompile_reason", "")) for m in recompiles][:10],
    }


def main(argv: List[str] = None) -> Dict[str, Any]:
    smoke = "tiny model on the CPU (aot_eager), for CI"
    parser = common.arguments(__doc__.splitlines()[0], "dynamic_shapes", smoke, steps=60, backend="inductor")
    parser.add_argument("--variants", default="plain,dynamic,buckets")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--buckets", type=lambda text: [int(x) for x in text.split(",")], default=[128, 256, 512, 1024])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    config = GPT2_SMALL_6
    if args.smoke:
        config = SMOKE
        args.steps, args.batch_size, args.min_length, args.max_length = 6, 2, 8, 64
        args.buckets, args.backend = [32, 64], "aot_eager"
    device = common.device_for(args.smoke)
    notes = [
        f"{args.steps} steps, batch {args.batch_size}, lengths uniform in {args.min_length}..{args.max_length} "
        f"(seed {args.seed}), {config.n_layer} layers, d={config.n_embd}, vocab {config.vocab_size}, "
        f"backend {args.backend}, buckets {args.buckets}",
        "total_s: the whole stream, compiles included; steady_step_ms: median of the faster half of the steps; "
        "tokens_per_s: real (unpadded) tokens over total_s; padding: padded / real tokens - 1",
    ]
    columns = COLUMNS + ["speedup_vs_plain"]
    rows = []
    for variant in variants:
        with compat.fresh_inductor_cache():
            rows.append(run_variant(variant, args, config, device))
        print(f"{variant}: {rows[-1]['total_s']:.1f} s, {rows[-1]['graphs']} graphs", flush=True)
        common.add_ratio(rows, "speedup_vs_plain", "total_s", lambda row: row["variant"] == "plain", inverse=True)
        # written after every variant, so a run cut short still leaves what it measured
        title = "Variable sequence lengths: plain vs dynamic vs buckets"
        common.write_result(args.out, "dynamic_shapes", title, columns, rows, notes)
    common.print_table(columns, rows, baseline="plain")
    return {"rows": rows}


if __name__ == "__main__":
    main()
