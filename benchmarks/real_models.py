"""Real models: eager vs torch.compile vs accelerate's compile_regions vs the bundled policies, side by side.

HF Llama (16 layers, d 1024, 8 KV heads; 8 x 1024 tokens), HF GPT-2 small (8 x 1024 tokens), ViT-B/16 and ResNet-50
(64 images of 224²) from ``benchmarks/models.py``; bf16 autocast, fused AdamW; each variant in a fresh process with
empty compile caches (``--isolation variant``): its first step is the cold compile a user pays. GPU run:

    python benchmarks/real_models.py --models llama gpt2 --out benchmarks/results/real_models.json
    python benchmarks/real_models.py --models vit resnet50 --append --out benchmarks/results/real_models.json

The models as users configure them (issue 31): ``llama_default`` (``use_cache=True``), ``convnext_tiny``,
``vit_drop_path`` (``drop_path_rate=0.1``; transformers' BEiT without timm) and ``t5_base`` (8 x 512 tokens):

    python benchmarks/real_models.py --models llama_default t5_base --policies regional --append
    python benchmarks/real_models.py --models convnext_tiny vit_drop_path --policies regional --append

CPU smoke run (tiny configs, aot_eager, all in one process): ``python benchmarks/real_models.py --smoke --out x``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from benchmarks.models import build_model, has_module  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    """One model's batch: ``batch`` sequences of ``size`` tokens, or ``batch`` images of ``size`` x ``size``."""

    family: str  # "lm" or "vision"
    batch: int
    size: int
    unit: str


LM, VISION = ModelSpec("lm", 8, 1024, "tokens"), ModelSpec("vision", 64, 224, "images")
# the last four as users configure them for training (issue 31): config defaults, stochastic depth, stages, 2 stacks
MODELS = {"llama": LM, "gpt2": LM, "vit": VISION, "resnet50": VISION, "llama_default": LM}
MODELS |= {"convnext_tiny": VISION, "vit_drop_path": VISION, "t5_base": ModelSpec("lm", 8, 512, "tokens")}
DEFAULT_MODELS = ["llama", "gpt2", "vit", "resnet50"]
# For the time estimate only: seconds of a cold first step on an H100 (torch 2.11), measured 2026-11-23 for llama
# and vit (a little warm), the rest guessed; "policy" is any policy (nested ones x 1.5), per peer in PEERS' order
# from torch_compile; each worker process adds PROCESS_GUESS_S (imports, CUDA, the model, FLOPs, timed steps).
COMPILE_GUESS = {
    "llama": (48, 52, 14, 12), "gpt2": (28, 31, 11, 12), "vit": (24, 26, 22, 7), "resnet50": (40, 45, 40, 20),
    "llama_default": (66, 69, 20, 25), "convnext_tiny": (54, 57, 54, 30), "vit_drop_path": (24, 26, 22, 10),
    "t5_base": (60, 64, 25, 25),
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
POLICY_PREFIX = "policy_"
DEFAULT_POLICIES = ["regional", "regional_split", "regional_nested"]
SMOKE_VARIANTS, SMOKE_POLICIES = ["eager", "torch_compile", "compile_regions"], ["regional", "regional_nested"]
CACHE_NOTE = "{}: built with use_cache=False, as the regional plan advises (with a KV cache each decoder layer reads"
CACHE_NOTE += " its layer_idx, in training too, and gets a compiled graph of its own)"
MODEL_NOTES = {  # what a reader of a model's rows should know, in the notes when the model runs
    "llama": CACHE_NOTE.format("llama"),
    "llama_default": "llama_default: the llama's shape with its config's defaults (use_cache=True)",
    "vit_drop_path": "vit_drop_path: drop_path_rate=0.1, each block its own rate (random: losses differ by variant)",
    "t5_base": "t5_base: t5-base's shape (12 + 12 layers, d 768), no dropout; 8 x 512 tokens in and out",
    "gpt2": CACHE_NOTE.format("gpt2") + "; its loss_function logs a warning_once per call, a graph break where the "
    "loss is compiled with the model (the policies have Dynamo drop that call)",
}
TIMM_NOTE = "accelerate's compile_regions finds repeated blocks in ModuleLists only: on timm's models (nn.Sequential)"
TIMM_NOTE += " it compiles the whole model"
LOSSES_COMPARED = 5  # the first steps' losses compared with eager's


def describe(variant: str) -> str:
    if variant in PEERS:
        return PEERS[variant]
    name, rest = policy_and_rest(variant)
    rules = f", rules=[every rule with rest={rest!r}]" if rest else ""
    return f"apply_policy(model, to_policy({name!r}{rules}))"


def policy_and_rest(variant: str) -> Tuple[str, Optional[str]]:
    """A policy variant's bundled policy and its ``rest`` override: ``policy_regional@rest=eager`` runs the
    bundled ``regional`` with every rule's ``rest`` set to ``eager`` (an experiment on what the rest costs)."""
    name, overrides = common.split_variant(variant[len(POLICY_PREFIX) :])
    rest = overrides.pop("rest", None)
    if overrides:
        raise ValueError(f"variant {variant!r}: only @rest=... is understood here, not @{', @'.join(overrides)}")
    return name, rest or None


def make_batches(name: str, smoke: bool, size: int, count: int, device: torch.device) -> Tuple[List[Any], int]:
    """``count`` batches of random data (the same in every process), and the tokens or images in one batch."""
    spec = MODELS[name]
    batch, length = SMOKE_BATCH if smoke else (spec.batch, spec.size)
    generator = torch.Generator().manual_seed(1)
    if spec.family == "lm":
        batches = [torch.randint(size, (batch, length), generator=generator) for _ in range(count)]
        return [b.to(device) for b in batches], batch * length
    batches = []
    for _ in range(count):
        images = torch.randn(batch, 3, length, length, generator=generator)
        batches.append((images.to(device), torch.randint(size, (batch,), generator=generator).to(device)))
    return batches, batch


def loss_of(family: str, run: Callable[..., Any], batch: Any) -> torch.Tensor:
    if family == "lm":
        return run(input_ids=batch, labels=batch).loss  # transformers shifts the labels
    return run(*batch)


def prepare(
    variant: str, model: nn.Module, args: argparse.Namespace
) -> Tuple[Callable[..., Any], Any, bool, List[str]]:
    """Compile ``model`` as the variant says: the callable a step runs, the applied policy (None for the peers),
    whether each step must mark a CUDA-graph step for torch.compile itself, and notes."""
    backend = args.backend or "inductor"
    if variant == "eager":
        return model, None, False, []
    if variant == "torch_compile":
        return torch.compile(model, backend=backend), None, False, []
    if variant == "torch_compile_reduce_overhead":
        if backend != "inductor":  # torch.compile takes a mode only with Inductor
            return torch.compile(model, backend=backend), None, False, [f"mode dropped: backend {backend}"]
        return torch.compile(model, mode="reduce-overhead"), None, True, []
    if variant == "compile_regions":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend), None, False, []
    from compile_trainer import apply_policy, to_policy

    name, rest = policy_and_rest(variant)
    policy = to_policy(name, **({"backend": args.backend} if args.backend else {}))
    if rest:
        policy = common.with_rule_changes(policy, rest=rest)
    holder = nn.ModuleDict({"model": model})  # policies address modules as a LightningModule would
    applied = apply_policy(holder, policy)
    return model, applied, False, list(applied.notes)


def run_variant(name: str, variant: str, args: argparse.Namespace, state: Dict[str, Any]) -> Dict[str, Any]:
    """Train model ``name`` under ``variant``; ``state`` keeps its FLOP count for the process's next variant."""
    from compile_trainer.telemetry.compile_events import CompileTelemetry

    device = common.device_for(args.smoke)
    spec = MODELS[name]
    torch.manual_seed(0)
    with device:  # initialized where it trains: on the GPU, seconds faster than on the host
        model, source, size = build_model(name, args.smoke)
    model.to(device).train()
    batches, items = make_batches(name, args.smoke, size, 4, device)
    if args.channels_last and spec.family == "vision":
        model.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    if "flops" not in state:
        try:
            loss = partial(loss_of, spec.family, model, batches[0])
            state["flops"] = models.count_flops(model, loss, device.type, autocast=device.type == "cuda")
        except Exception as error:  # no MFU, but the variant's other numbers
            state["flops"], state["flops_error"] = None, f"FLOPs not counted: {type(error).__name__}: {error}"[:300]
    flops = state["flops"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    run, applied, mark_step, notes = prepare(variant, model, args)  # compiles nothing yet: that is lazy
    telemetry = CompileTelemetry(applied).install()  # attributes a policy's compiles to its regions
    try:
        result = measure(spec, run, applied, mark_step, optimizer, batches, args, device, telemetry)
    finally:
        telemetry.uninstall()
        if applied is not None:
            applied.remove()  # and the process-wide settings it changed (the recompile limit)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else common.peak_flops(device)
    step_s, window_s = result.pop("step_s"), result.pop("window_s")
    return {"source": source, **result} | {
        "items_per_s": items * args.steps / window_s,
        "unit": spec.unit,
        "flops_per_step": flops,
        "tflops": flops / step_s / 1e12 if flops else None,
        "mfu": flops / step_s / peak if flops and peak else None,
        "notes": notes + ([state["flops_error"]] if "flops_error" in state else []),
    }


def measure(spec, run, applied, mark_step, optimizer, batches, args, device, telemetry) -> Dict[str, Any]:
    """The first step (timed alone), the warm-up, the timed steps; what the compiler did meanwhile."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    train = common.training_step(optimizer, partial(loss_of, spec.family, run), device, applied, mark_step=mark_step)
    losses: List[torch.Tensor] = []

    def step(index: int) -> None:
        loss = train(batches[index % len(batches)])
        if len(losses) < LOSSES_COMPARED:
            losses.append(loss.clone())  # a CUDA-graph output is overwritten by the next replay

    times = common.first_warm_timed(device, step, args.warmup, args.steps)
    telemetry.collect()
    totals = telemetry.totals()
    return {
        "first_step_s": times["first_step_s"],
        "step_ms": times["step_s"] * 1e3,
        "step_s": times["step_s"],
        "slowest_step_ms": times["slowest_step_s"] * 1e3,
        "window_s": times["window_s"],
        "peak_mem_gib": common.peak_memory_gib(device),
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": totals["recompiles"],
        "grad_mode_variants": totals["grad_mode_variants"],
        "graph_breaks": totals["graph_breaks"],
        "cudagraph_skips": totals["cudagraph_skips"],
        "compile_s": totals["compile_time_s"],
        # Each compile (a frame's forward, or its lazily compiled backward) and its seconds, in order.
        "compiles": [
            [str(m.compile_id), m.co_name or "backward", round(common.frame_compile_seconds(m), 3)]
            for m in get_compilation_metrics()
        ],
        "recompile_reasons": common.recompile_reasons(limit=10),
        "losses": [float(loss) for loss in losses],
    }


def run_worker(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """``args.worker_runs`` (``model:variant``) in turn, compiler state and caches reset before each; the results
    written after each (a run cut short keeps the ones before)."""
    if torch.cuda.is_available() and not args.smoke:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    results: Dict[str, Dict[str, Any]] = {}
    states: Dict[str, Dict[str, Any]] = {}  # per model: its FLOP count
    for run in args.worker_runs:
        name, variant = run.split(":")
        try:
            with common.fresh_compiler_state():
                results[run] = run_variant(name, variant, args, states.setdefault(name, {}))
        except Exception as error:  # one variant's failure is its row, not the end of the run
            message = f"{type(error).__name__}: {error}".strip()[:400]
            results[run] = {"error": message, "traceback": traceback.format_exc()}
        args.worker_out.write_text(json.dumps(results))
    return results


def precheck(variant: str) -> Optional[str]:
    """Why ``variant`` cannot run here (checked without starting a worker), or None."""
    if variant == "compile_regions" and not has_module("accelerate"):
        return "accelerate not installed"
    if variant.startswith(POLICY_PREFIX):
        from compile_trainer.schema.load import bundled_policy_names

        try:
            name, _ = policy_and_rest(variant)
        except ValueError as error:
            return str(error)
        if name not in bundled_policy_names():
            return f"unknown compile policy {name!r} (bundled: {', '.join(bundled_policy_names())})"
        if not has_module("omegaconf"):
            return "omegaconf not installed (compile_trainer.to_policy needs it)"
    return None


def guess_seconds(name: str, variant: str) -> float:
    if variant == "eager":
        return 0.0
    if variant.startswith(POLICY_PREFIX):
        return COMPILE_GUESS[name][3] * (1.5 if variant.endswith("nested") else 1.0)
    return COMPILE_GUESS[name][list(PEERS).index(variant) - 1]


def worker_groups(runs: List[Tuple[str, str]], isolation: str) -> List[List[Tuple[str, str]]]:
    """The runs each worker process does: one per process, the runs of one model, or all of them."""
    if isolation == "variant":
        return [[run] for run in runs]
    if isolation == "model":
        return [[run for run in runs if run[0] == name] for name in dict.fromkeys(name for name, _ in runs)]
    return [runs] if runs else []


def estimate(runs: List[Tuple[str, str]], args: argparse.Namespace) -> None:
    """Print the guessed wall seconds per model on an H100 (for planning a 10-minute command; not a measurement)
    and, over ``--budget-s``, the models grouped into commands that fit."""
    per_model: Dict[str, float] = {}
    for group in worker_groups(runs, args.isolation):
        for index, (name, variant) in enumerate(group):
            start = PROCESS_GUESS_S if index == 0 else 5  # a new process, or the model built again
            per_model[name] = per_model.get(name, 0.0) + start + guess_seconds(name, variant)
    guessed, each = sum(per_model.values()), ", ".join(f"{n} ~{s:.0f} s" for n, s in per_model.items())
    print(f"estimate for an H100 (a few first steps measured, the rest guessed): {each}; ~{guessed:.0f} s in all, "
          f"budget {args.budget_s:.0f} s", flush=True)  # fmt: skip
    if guessed <= args.budget_s or args.smoke:
        return
    print("over budget: split it, e.g.", flush=True)
    groups, used = [[]], 0.0
    for name, seconds in per_model.items():
        if groups[-1] and used + seconds > args.budget_s:
            groups, used = groups + [[]], 0.0
        groups[-1].append(name)
        used += seconds
    for index, group in enumerate(groups):  # the first command starts the file, the others add to it
        print(
            f"  python benchmarks/real_models.py --models {' '.join(group)}{' --append' * bool(index)} --out {args.out}"
        )


def run_worker_process(runs: List[Tuple[str, str]], args: argparse.Namespace, timeout: float) -> Dict:
    """``runs`` in one fresh process with empty compile caches (emptied again before each run); a failure's
    output and each run's traceback go to one log beside ``--out``."""
    keys = [f"{name}:{variant}" for name, variant in runs]
    log = args.out.with_name(f"{args.out.stem}.errors.log")
    passthrough = [*args.passthrough, f"--variant-timeout={int(timeout)}"]
    results = common.run_fresh(__file__, ["--worker-runs", *keys, *passthrough], timeout, log=log)
    error, _ = results.pop("error", None), results.pop("process_s")
    for key in keys:
        if "traceback" in results.get(key, {}):
            with log.open("a") as file:
                file.write(f"==== {key} ({time.strftime('%H:%M:%S')})\n{results[key].pop('traceback').rstrip()}\n\n")
            results[key]["log"] = log.name
    return {run: results.get(key) or {"error": error or "no result"} for run, key in zip(runs, keys)}


def summarize(results: Dict[Tuple[str, str], Dict[str, Any]], order: List[Tuple[str, str]]) -> List[Dict[str, Any]]:
    """One row per (model, variant) in ``order``, with ratios against eager and the best full compile of the same
    model: ``torch.compile(model)`` in its default mode or with reduce-overhead, whichever ran faster."""
    rows = []
    for name, variant in order:
        result = results[(name, variant)]
        row: Dict[str, Any] = {"model": name, "variant": variant, "compiled": describe(variant)}
        if "error" in result:
            rows.append(row | {k: v for k, v in result.items() if k in ("error", "log", "source")})
            continue
        row |= {k: v for k, v in result.items() if k not in ("losses", "notes")}
        eager = results.get((name, "eager"), {})
        fulls = [(v, results.get((name, v), {})) for v in FULL_COMPILES]
        fulls = [(v, f) for v, f in fulls if "items_per_s" in f]
        best_name, best = max(fulls, key=lambda item: item[1]["items_per_s"]) if fulls else (None, None)
        if "items_per_s" in eager:
            row["speedup_vs_eager"] = result["items_per_s"] / eager["items_per_s"]
            row["loss_rel_diff_vs_eager"] = common.rel_diff(result["losses"], eager["losses"])
        if best is not None:
            row["full_compile"] = best_name
            row["throughput_vs_full"] = result["items_per_s"] / best["items_per_s"]
            row["first_step_vs_full"] = result["first_step_s"] / best["first_step_s"]
        row["first_losses"] = result["losses"]
        row["notes"] = result.get("notes") or None
        rows.append(row)
    return rows


COLUMNS = """model variant first_step_s compile_s step_ms items_per_s unit speedup_vs_eager throughput_vs_full
first_step_vs_full full_compile graphs recompiles graph_breaks tflops mfu peak_mem_gib loss_rel_diff_vs_eager
error""".split()
# Row fields summarize() derives from the results; --append recomputes them.
DERIVED = ("model", "variant", "compiled", "speedup_vs_eager", "loss_rel_diff_vs_eager", "full_compile")
DERIVED += ("throughput_vs_full", "first_step_vs_full", "first_losses")
TABLE_COLUMNS = [c for c in COLUMNS if c not in ("unit", "full_compile", "tflops")]
TITLE = "Real models (HF Llama, HF GPT-2, ViT-B/16, ResNet-50): eager, torch.compile, peers and policies"
ISOLATED = {
    "variant": "a fresh process with empty Inductor/Triton caches per variant",
    "model": "one process per model, Dynamo reset and empty Inductor/Triton caches before each variant",
    "run": "one process for the whole run, Dynamo reset and empty Inductor/Triton caches before each variant",
}


def batch_text(name: str, smoke: bool) -> str:
    spec = MODELS[name]
    batch, size = SMOKE_BATCH if smoke else (spec.batch, spec.size)
    return f"{batch} x {size} tokens" if spec.family == "lm" else f"{batch} images of 3 x {size} x {size}"


def main() -> None:
    smoke = "tiny configs on the CPU, aot_eager, few steps"
    parser = common.arguments(__doc__, "real_models", smoke, steps=30, warmup=5, backend=None, variant_timeout=150)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", choices=list(PEERS), help="the peers to run (default: all)")
    parser.add_argument("--policies", nargs="*", help=f"bundled policies, each as policy_<name> ({DEFAULT_POLICIES})")
    parser.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s for MFU (default: 989.4 on H100/H200)")
    parser.add_argument("--channels-last", action="store_true", help="vision models and images in channels_last")
    parser.add_argument(
        "--isolation",
        choices=list(ISOLATED),
        help="a fresh process per variant (default; the honest cold start), per model, or one for the run (default "
        "with --smoke); the last two miss in a first step what a process compiles or loads once (imports, CUDA)",
    )
    parser.add_argument("--budget-s", type=float, default=540, help="variants that would start past it: error rows")
    parser.add_argument("--append", action="store_true", help="keep --out's rows of (model, variant)s not run now")
    parser.add_argument("--estimate", action="store_true", help="print the time estimate and exit")
    common.hidden(parser, "--worker-runs", nargs="+")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.backend = min(args.steps, 3), 2, args.backend or "aot_eager"
        args.isolation = args.isolation or "run"
        args.variants = SMOKE_VARIANTS if args.variants is None else args.variants
        args.policies = SMOKE_POLICIES if args.policies is None else args.policies
    args.isolation = args.isolation or "variant"
    args.variants = list(PEERS) if args.variants is None else args.variants
    args.policies = DEFAULT_POLICIES if args.policies is None else args.policies
    if args.worker_runs:
        return common.worker(args.worker_out, lambda: run_worker(args), args.variant_timeout)

    variants = args.variants + [POLICY_PREFIX + p for p in args.policies]
    requested = [(name, variant) for name in args.models for variant in variants]
    why_not = {variant: precheck(variant) for variant in variants}
    runs = [(name, variant) for name, variant in requested if why_not[variant] is None]
    estimate(runs, args)
    if args.estimate:
        return
    args.passthrough = common.flags(
        steps=args.steps, warmup=args.warmup, backend=args.backend, peak_tflops=args.peak_tflops, smoke=args.smoke,
        channels_last=args.channels_last,
    )  # fmt: skip

    meta = common.environment() | {"isolation": args.isolation}
    results: Dict[Tuple[str, str], Dict[str, Any]] = {}
    order: List[Tuple[str, str]] = []
    old: Dict[str, Any] = {"notes": []}
    if args.append and args.out.exists():
        old = json.loads(args.out.read_text())
        meta["command"] = f"{old['meta'].get('command')} && {meta['command']}"
        if old["meta"].get("isolation") not in (None, args.isolation):
            meta["isolation"] = f"{old['meta']['isolation']} + {args.isolation}"
        for row in old["rows"]:  # kept unless run again; ratios are recomputed with this run's rows
            if (row["model"], row["variant"]) not in requested:
                kept = {k: v for k, v in row.items() if k not in DERIVED}
                results[(row["model"], row["variant"])] = kept | {"losses": row.get("first_losses") or []}
                order.append((row["model"], row["variant"]))
    order += requested
    results.update({run: {"error": why_not[run[1]]} for run in requested if why_not[run[1]] is not None})
    notes = [f"{m}: {batch_text(m, args.smoke)} a step" for m in args.models]
    notes += [MODEL_NOTES[m] for m in args.models if m in MODEL_NOTES]
    vision = {"vit", "resnet50", "vit_drop_path", "convnext_tiny"} & set(args.models)
    notes += [TIMM_NOTE] if has_module("timm") and vision and "compile_regions" in variants else []
    notes += [
        f"{args.steps} timed steps (median step time; items/s over the timed window) after {args.warmup} warm-up "
        f"steps, the first timed alone (first_step_s); backend {args.backend or 'inductor'}; "
        + ISOLATED[args.isolation],
        "random weights and data, dropout off; bf16 autocast and fused AdamW on the GPU (fp32 on the CPU); *_vs_full: "
        "against full_compile, the faster of torch_compile and torch_compile_reduce_overhead on the same model; "
        f"loss_rel_diff_vs_eager: of the first {LOSSES_COMPARED} losses; MFU from FlopCounterMode's count of one "
        "eager forward and backward",
    ]
    notes = old["notes"] + [note for note in notes if note not in old["notes"]]  # --append: both runs' notes
    started = time.perf_counter()
    skipped: List[Tuple[str, str]] = []

    def save(done: List[Tuple[str, str]]) -> List[Dict[str, Any]]:
        rows, wall = summarize(results, done), {"wall_s": time.perf_counter() - started}
        common.write_result(args.out, "real_models", TITLE, COLUMNS, rows, notes, meta | wall)
        return rows

    for group in worker_groups(runs, args.isolation):
        left = args.budget_s - (time.perf_counter() - started)
        if left < PROCESS_GUESS_S + guess_seconds(*group[0]):  # it would likely time out: leave it to another command
            why = f"skipped: not enough of the run's --budget-s {args.budget_s:.0f} s left; run it in another command"
            results.update({run: {"error": why} for run in group})
            skipped += group
            continue
        timeout = min(args.variant_timeout * len(group), left)
        for (name, variant), result in run_worker_process(group, args, timeout).items():
            results[(name, variant)] = result
            print(f"{name} {variant}: {json.dumps(result)[:300]}", flush=True)
        save([key for key in order if key in results])
    rows = save(order)
    common.print_table(TABLE_COLUMNS, rows, baseline="eager (speedup), the faster full compile (*_vs_full)")
    diffs = [r["loss_rel_diff_vs_eager"] for r in rows if r.get("loss_rel_diff_vs_eager") is not None]
    if diffs:
        print(f"first losses vs eager: largest relative difference {max(diffs):.2e}")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    if skipped:
        models = " ".join(dict.fromkeys(name for name, _ in skipped))
        peers = " ".join(dict.fromkeys(v for _, v in skipped if not v.startswith(POLICY_PREFIX)))
        policies = " ".join(dict.fromkeys(v[len(POLICY_PREFIX) :] for _, v in skipped if v.startswith(POLICY_PREFIX)))
        print(f"{len(skipped)} variants skipped for the budget; to run them (and those models' other variants again):")
        print(f"  python benchmarks/real_models.py --models {models} --variants {peers} --policies {policies} --append")


if __name__ == "__main__":
    main()
