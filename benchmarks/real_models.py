"""Real models: eager vs torch.compile vs accelerate's compile_regions vs the bundled policies, side by side.

HF Llama (16 layers, d 1024, 8 KV heads; 8 x 1024 tokens), HF GPT-2 small (8 x 1024 tokens), ViT-B/16 and ResNet-50
(64 images of 224²), and the models as users configure them (issue 31): ``llama_default`` (``use_cache=True``),
``convnext_tiny``, ``vit_drop_path`` (``drop_path_rate=0.1``), ``t5_base`` and ``bart_base`` (8 x 512 tokens); all from
``benchmarks/models.py``. bf16 autocast, fused AdamW; each variant in a fresh process with empty compile caches: its
first step is the cold compile a user pays. ``--policies regional@rest=outer``: every rule's ``rest`` replaced.

    python benchmarks/real_models.py --models llama gpt2 --budget-s 540
    python benchmarks/real_models.py --models t5_base vit_drop_path --policies regional --append
    python benchmarks/real_models.py --smoke --out /tmp/x   # CPU: tiny configs, aot_eager, all in one process
"""

import argparse
import collections
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch._dynamo.utils import get_compilation_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer import BackgroundCompile, apply_policy  # noqa: E402
from compile_trainer.schema.load import bundled_policy_names  # noqa: E402
from compile_trainer.telemetry.compile_events import CompileTelemetry  # noqa: E402

# One model's batch: ``batch`` sequences of ``size`` tokens (family "lm"), or ``batch`` images of ``size`` x ``size``
ModelSpec = collections.namedtuple("ModelSpec", "family batch size unit")
LM, VISION = ModelSpec("lm", 8, 1024, "tokens"), ModelSpec("vision", 64, 224, "images")
# the last five as users configure them for training (issue 31): config defaults, stochastic depth, stages, 2 stacks
MODELS = {"llama": LM, "gpt2": LM, "vit": VISION, "resnet50": VISION, "llama_default": LM}
ENCODER_DECODER = ModelSpec("lm", 8, 512, "tokens")
MODELS |= {"convnext_tiny": VISION, "vit_drop_path": VISION, "t5_base": ENCODER_DECODER, "bart_base": ENCODER_DECODER}
# For --budget-s only: seconds of a cold first step on an H100 (torch 2.11), measured 2026-11-23 for llama and vit
# (a little warm), the rest guessed; "policy" is any policy (nested ones x 1.5), per peer in PEERS' order from
# torch_compile; each worker process adds PROCESS_GUESS_S (imports, CUDA, the model, FLOPs, timed steps).
COMPILE_GUESS = {
    "llama": (48, 52, 14, 12), "gpt2": (28, 31, 11, 12), "vit": (24, 26, 22, 7), "resnet50": (40, 45, 40, 20),
    "llama_default": (66, 69, 20, 25), "convnext_tiny": (54, 57, 54, 30), "vit_drop_path": (24, 26, 22, 10),
    "t5_base": (60, 64, 25, 25), "bart_base": (40, 44, 20, 15),
}  # fmt: skip
PROCESS_GUESS_S = 15
SMOKE_BATCH = (2, 32)  # sequences of 32 tokens, or images of 32 x 32
PEERS = {
    "eager": "none",
    "torch_compile": "torch.compile(model)",
    "torch_compile_reduce_overhead": "torch.compile(model, mode='reduce-overhead')",
    "compile_regions": "accelerate.utils.compile_regions(model)",
}
FULL_COMPILES = ("torch_compile", "torch_compile_reduce_overhead")
SMOKE_PEERS = ["eager", "torch_compile", "compile_regions"]
POLICY_PREFIX = "policy_"
CACHE_NOTE = "{}: built with use_cache=False, as the regional plan advises (with a KV cache each decoder layer reads"
CACHE_NOTE += " its layer_idx, in training too, and gets a compiled graph of its own)"
MODEL_NOTES = {  # what a reader of a model's rows should know, in the notes when the model runs
    "llama": CACHE_NOTE.format("llama"),
    "llama_default": "llama_default: the llama's shape with its config's defaults (use_cache=True)",
    "vit_drop_path": "vit_drop_path: drop_path_rate=0.1, each block its own rate (random: losses differ by variant)",
    "t5_base": "t5_base: t5-base's shape (12 + 12 layers, d 768), no dropout; 8 x 512 tokens in and out",
    "bart_base": "bart_base: facebook/bart-base's shape (6 + 6 layers, d 768), no dropout; 8 x 512 tokens in and out",
    "gpt2": CACHE_NOTE.format("gpt2") + "; its loss_function logs a warning_once per call, a graph break where the "
    "loss is compiled with the model (the policies have Dynamo drop that call)",
}
TIMM_NOTE = "accelerate's compile_regions finds repeated blocks in ModuleLists only: on timm's models (nn.Sequential)"
TIMM_NOTE += " it compiles the whole model"
LOSSES_COMPARED = 5  # the first steps' losses compared with eager's


def make_batches(name: str, smoke: bool, size: int, device: torch.device) -> Tuple[List[Any], int]:
    """Four batches of random data (the same in every process), and the tokens or images in one batch."""
    spec = MODELS[name]
    batch, length = SMOKE_BATCH if smoke else (spec.batch, spec.size)
    generator = torch.Generator().manual_seed(1)
    if spec.family == "lm":
        return [torch.randint(size, (batch, length), generator=generator).to(device) for _ in range(4)], batch * length
    images = [torch.randn(batch, 3, length, length, generator=generator) for _ in range(4)]
    return [(x.to(device), torch.randint(size, (batch,), generator=generator).to(device)) for x in images], batch


def loss_of(family: str, run: Callable[..., Any], batch: Any) -> torch.Tensor:
    if family == "lm":
        return run(input_ids=batch, labels=batch).loss  # transformers shifts the labels
    return run(*batch)


def prepare(variant: str, model: nn.Module, args: argparse.Namespace) -> Tuple[Callable[..., Any], Any, bool, List]:
    """Compile ``model`` as the variant says: the callable a step runs, the applied policy (None for the peers),
    whether each step must mark a CUDA-graph step for torch.compile itself, and notes."""
    backend = args.backend or "inductor"
    if variant == "eager":
        return model, None, False, []
    if variant in FULL_COMPILES:  # torch.compile takes a mode only with Inductor
        cuda_graphs = variant == "torch_compile_reduce_overhead" and backend == "inductor"
        dropped = [f"mode dropped: backend {backend}"] if variant.endswith("overhead") and not cuda_graphs else []
        mode = "reduce-overhead" if cuda_graphs else None
        return torch.compile(model, backend=backend, mode=mode), None, cuda_graphs, dropped
    if variant == "compile_regions":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend), None, False, []
    policy = common.variant_policy(variant[len(POLICY_PREFIX) :], **({"backend": args.backend} if args.backend else {}))
    applied = apply_policy(nn.ModuleDict({"model": model}), policy)  # modules addressed as in a LightningModule
    return model, applied, False, list(applied.notes)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Train ``args.model`` under ``args.variant``: the first step (timed alone), the warm-up, the timed steps, and
    what the compiler did meanwhile."""
    device, spec = common.device_for(args.smoke), MODELS[args.model]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    with device:  # initialized where it trains: on the GPU, seconds faster than on the host
        model, source, size = models.build_model(args.model, args.smoke)
    model.to(device).train()
    batches, items = make_batches(args.model, args.smoke, size, device)
    flops, notes = None, []
    try:
        flops = models.count_flops(model, partial(loss_of, spec.family, model, batches[0]), device)
    except Exception as error:  # no MFU, but the variant's other numbers
        notes.append(f"FLOPs not counted: {type(error).__name__}: {error}"[:300])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    run, applied, mark_step, compile_notes = prepare(args.variant, model, args)  # compiles nothing yet: that is lazy
    background = BackgroundCompile(applied) if applied is not None and applied.defers_compiles else None
    telemetry = CompileTelemetry(applied).install()  # attributes a policy's compiles to its regions
    train = common.training_step(optimizer, partial(loss_of, spec.family, run), device, applied, mark_step=mark_step)
    losses: List[torch.Tensor] = []

    def step(index: int) -> None:
        if background is not None:
            background.poll()
        loss = train(batches[index % len(batches)])
        if len(losses) < LOSSES_COMPARED:
            losses.append(loss.clone())  # a CUDA-graph output is overwritten by the next replay

    try:
        compiling = lambda: background is not None and not background.installed  # noqa: E731
        times = common.first_warm_timed(device, step, args.warmup, args.steps, compiling, max_eager=10**5)
        telemetry.collect()
        totals = telemetry.totals()
    finally:
        telemetry.uninstall()
        if applied is not None:
            applied.remove()  # and the process-wide settings it changed (the recompile limit)
    return common.timed_row(times, device, flops) | {
        "source": source,
        **{key: totals[key] for key in ("recompiles", "grad_mode_variants", "graph_breaks", "cudagraph_skips")},
        "compile_s": totals["compile_time_s"],
        # Each compile (a frame's forward, or its lazily compiled backward) and its seconds, in order.
        "compiles": [
            [str(m.compile_id), m.co_name or "backward", round(common.frame_compile_seconds(m), 3)]
            for m in get_compilation_metrics()
        ],
        "recompile_reasons": common.recompile_reasons(limit=10),
        # the breaks graph_breaks counts (not the policy's declared ones): where, and why
        "graph_break_reasons": [
            f"{b.region}: {b.short_reason} at {b.location}" for b in telemetry.graph_breaks() if not b.declared
        ][:10],
        "first_losses": [float(loss) for loss in losses],
        "background": background.summary() if background is not None else None,
        "items_per_s": items * args.steps / times["window_s"],
        "unit": spec.unit,
        "flops_per_step": flops,
        "notes": compile_notes + notes or None,
    }


def guess_seconds(model: str, variant: str) -> float:
    """A run's guessed wall seconds on an H100 (``COMPILE_GUESS``; not a measurement)."""
    if variant == "eager":
        return PROCESS_GUESS_S
    if variant.startswith(POLICY_PREFIX):
        return PROCESS_GUESS_S + COMPILE_GUESS[model][3] * (1.5 if "nested" in variant else 1.0)
    return PROCESS_GUESS_S + COMPILE_GUESS[model][list(PEERS).index(variant) - 1]


def skip(run: Dict[str, Any], args: argparse.Namespace) -> Optional[str]:
    """Why a run cannot run here (checked without starting a worker), or would likely not end within ``--budget-s``."""
    variant = run["variant"]
    if variant == "compile_regions" and not models.has_module("accelerate"):
        return "accelerate not installed"
    name = variant[len(POLICY_PREFIX) :].split("@")[0]
    if variant.startswith(POLICY_PREFIX) and name not in bundled_policy_names():
        return f"unknown compile policy {name!r} (bundled: {', '.join(bundled_policy_names())})"
    if not args.smoke and args.budget_s - (time.perf_counter() - args.started) < guess_seconds(run["model"], variant):
        return f"skipped: not enough of the run's --budget-s {args.budget_s:.0f} s left; run it in another command"
    return None


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every model under every variant; prints the guessed wall seconds per model on an H100, to plan commands that
    fit ``--budget-s``."""
    variants = args.variants + [POLICY_PREFIX + p for p in args.policies]
    per_model = {m: sum(guess_seconds(m, v) for v in variants) for m in args.models}
    each = ", ".join(f"{m} ~{s:.0f} s" for m, s in per_model.items())
    print(f"estimate for an H100 (a few first steps measured, the rest guessed): {each}; "
          f"~{sum(per_model.values()):.0f} s in all, budget {args.budget_s:.0f} s", flush=True)  # fmt: skip
    described = {v: PEERS.get(v, f"apply_policy(model, {v[len(POLICY_PREFIX) :]!r})") for v in variants}
    return [{"model": m, "variant": v, "compiled": described[v]} for m in args.models for v in variants]


def summarize(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Ratios against eager and the best full compile of the same model: ``torch.compile(model)`` in its default
    mode or with reduce-overhead, whichever ran faster."""
    measured = {(row["model"], row["variant"]): row for row in rows if "items_per_s" in row}
    for row in rows:
        if row.get("error"):
            continue
        eager = measured.get((row["model"], "eager"), {})
        fulls = [(v, measured[(row["model"], v)]) for v in FULL_COMPILES if (row["model"], v) in measured]
        if eager:
            row["speedup_vs_eager"] = row["items_per_s"] / eager["items_per_s"]
            row["loss_rel_diff_vs_eager"] = common.rel_diff(row["first_losses"], eager["first_losses"])
        if fulls:
            row["full_compile"], best = max(fulls, key=lambda item: item[1]["items_per_s"])
            row["throughput_vs_full"] = row["items_per_s"] / best["items_per_s"]
            row["first_step_vs_full"] = row["first_step_s"] / best["first_step_s"]
    return rows


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    def batch_text(spec: ModelSpec) -> str:
        batch, size = SMOKE_BATCH if args.smoke else (spec.batch, spec.size)
        return f"{batch} x {size} tokens" if spec.family == "lm" else f"{batch} images of 3 x {size} x {size}"

    notes = [f"{m}: {batch_text(MODELS[m])} a step" for m in args.models]
    notes += [MODEL_NOTES[m] for m in args.models if m in MODEL_NOTES]
    vision = {"vit", "resnet50", "vit_drop_path", "convnext_tiny"} & set(args.models)
    notes += [TIMM_NOTE] if models.has_module("timm") and vision and "compile_regions" in args.variants else []
    return notes + [
        f"{args.steps} timed steps (median step time; items/s over the timed window) after {args.warmup} warm-up "
        f"steps and a full garbage collection, the first timed alone (first_step_s); "
        f"backend {args.backend or 'inductor'}; "
        + ("one process, compiler state reset per variant" if args.smoke else "a fresh process per variant"),
        "random weights and data, dropout off; bf16 autocast and fused AdamW on the GPU (fp32 on the CPU); *_vs_full: "
        "against full_compile, the faster of torch_compile and torch_compile_reduce_overhead on the same model; "
        f"loss_rel_diff_vs_eager: of the first {LOSSES_COMPARED} losses; MFU from FlopCounterMode's count of one "
        "eager forward and backward",
    ]


BENCHMARK = common.Benchmark(
    name="real_models",
    title="Real models (HF Llama, HF GPT-2, ViT-B/16, ResNet-50): eager, torch.compile, peers and policies",
    columns="""model variant first_step_s compile_s step_ms items_per_s unit speedup_vs_eager throughput_vs_full
    first_step_vs_full full_compile graphs recompiles graph_breaks tflops mfu peak_mem_gib loss_rel_diff_vs_eager
    error""".split(),
    runs=runs,
    measure=measure,
    shared=dict(steps=30, warmup=25, backend=None, variant_timeout=150),
    options={
        "--models": dict(nargs="+", default=["llama", "gpt2", "vit", "resnet50"], choices=list(MODELS)),
        "--variants": dict(nargs="*", choices=list(PEERS), default=list(PEERS), help="the peers to run"),
        "--policies": dict(nargs="*", default=["regional", "regional_split", "regional_nested"], help="policy_<name>"),
        "--budget-s": dict(type=float, default=540, help="variants that would start past it: error rows"),
    },
    smoke=dict(steps=3, warmup=2, backend="aot_eager", policies=["regional", "regional_nested"], variants=SMOKE_PEERS),
    finish=summarize,
    notes=notes,
    skip=skip,
    in_process=lambda args: args.smoke,
    key=("model", "variant"),
    baseline="eager (speedup), the faster full compile (*_vs_full)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
