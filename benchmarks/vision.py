"""timm's vision models as their recipes train them, through Lightning: each built with its usual stochastic depth
(ConvNeXt-T and Swin-T 0.1, EfficientNet-B0 0.2, ViT-B/16 0.1, ResNet-50 none), random weights, in a plain
LightningModule fed ``(images, labels)`` tuples of 64 x 224 x 224, ``Trainer(precision="bf16-mixed")``, fused AdamW.
Variants: ``CompileCallback`` with a bundled policy (``regional``, ``reduce_overhead``, ``full``; ``name@key=value``
changes every rule of it) and accelerate's ``compile_regions`` by hand. Each variant a fresh process with empty
compile caches; it trains until its compiled regions are in use (after a background install) and ``--steady`` steps
more. Reported: the first step and the steady steps by the benchmark's clock (CUDA events), and the callback's own
summary beside them (first step, steps/s, images/s), with the ratios to the faster whole-model compile of the run.

``--profile MODEL:VARIANT`` records steady steps under torch.profiler instead and prints the top kernels, the GPU's
idle time inside the step (between the compiled graphs) and the layout conversions (``copy_``, ``contiguous``,
``clone``, ``to``), with a trace for Perfetto / chrome://tracing beside the result file.

    python benchmarks/vision.py --models convnext_tiny --out /tmp/vision/convnext.json
    python benchmarks/vision.py --models '' --profile convnext_tiny:regional,convnext_tiny:reduce_overhead
    python benchmarks/vision.py --smoke --out /tmp/vision.json          # CPU, tiny models, aot_eager
"""

import argparse
import gzip
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.lightning_dropin import INSTALL_STEPS, Plain, StepClock  # noqa: E402
from compile_trainer import CompileCallback  # noqa: E402

# model: its recipe's drop path; under --smoke, sizes for the CPU (the same block structures, tiny widths)
MODELS: Dict[str, Dict[str, Any]] = {
    "convnext_tiny": dict(drop_path_rate=0.1),
    "swin_tiny_patch4_window7_224": dict(drop_path_rate=0.1),
    "efficientnet_b0": dict(drop_path_rate=0.2),
    "vit_base_patch16_224": dict(drop_path_rate=0.1),
    "resnet50": dict(),
}
SMOKE = {
    "convnext_tiny": dict(dims=(8, 16, 32, 64)),
    "swin_tiny_patch4_window7_224": dict(img_size=32, patch_size=2, window_size=2, embed_dim=8, num_heads=(1, 1, 2, 2)),
    "efficientnet_b0": dict(),
    "vit_base_patch16_224": dict(img_size=32, patch_size=8, embed_dim=32, depth=6, num_heads=2),
    "resnet50": dict(channels=(8, 16, 32, 64), stem_width=8),
}
# cycled through, on the device from the start (64 x 3 x 224² in fp32: 38.5 MB each), so that the steps measure the
# model and not a host-to-device copy
DISTINCT_BATCHES = 16
WHOLE = ("reduce_overhead", "full")  # the whole-model compiles: the ratios' base is the faster one
SUMMARY_RATES = ("steady_images_per_s", "steady_samples_per_s", "steady_items_per_s")  # the first there is read
LAYOUT_OPS = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy")
# kernels that move a tensor to another layout: cuDNN's NCHW <-> NHWC transforms, Inductor's clones and copies
LAYOUT_KERNELS = ("nchwtonhwc", "nhwctonchw", "clone", "copy", "transpose", "permute")
ANNOTATIONS = ("Torch-Compiled Region", "CompiledFunction", "ProfilerStep", "##", "aten::", "autograd::", "Optimizer")
COLUMNS = [
    "model", "variant", "first_step_s", "step_ms", "images_per_s", "steps_per_s", "first_step_vs_full",
    "throughput_vs_full", "summary_first_step_s", "summary_steps_per_s", "summary_images_per_s", "summary_vs_own",
    "steps", "background_eager_steps", "graphs", "recompiles", "graph_breaks", "plan", "error",
]  # fmt: skip


def build(model: str, smoke: bool) -> nn.Module:
    import timm

    return timm.create_model(
        model, pretrained=False, num_classes=1000, **MODELS[model], **(SMOKE[model] if smoke else {})
    )


def batches(model: str, smoke: bool, count: int) -> List[Any]:
    generator = torch.Generator().manual_seed(0)
    size, side = (4, 32) if smoke else (64, 224)
    images = [torch.randn(size, 3, side, side, generator=generator) for _ in range(count)]
    return [(x, torch.randint(0, 1000, (size,), generator=generator)) for x in images]


class UntilSteady(pl.Callback):
    """Stops the fit ``steady`` steps after the compiled regions are in use and warmed up (a background compile's
    install, then ``INSTALL_STEPS`` that record CUDA graphs); ``first_steady``: the index of the first such step."""

    def __init__(self, callback: Optional[CompileCallback], steady: int) -> None:
        self.callback, self.steady, self.first_steady = callback, steady, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        background = self.callback.background if self.callback is not None else None
        if self.first_steady is None and (background is None or background.installed):
            self.first_steady = max(batch_idx + 1 + INSTALL_STEPS, 2)
        if self.first_steady is not None and batch_idx + 1 >= self.first_steady + self.steady:
            trainer.should_stop = True


def variant_policy(variant: str, backend: Dict[str, str]) -> Any:
    """``common.variant_policy``'s ``name@key=value@...``, where a key may also be one of the policy's own settings
    (``regional@regional_min_reuse=4.5``)."""
    from compile_trainer.schema import CompilePolicy

    name, *pairs = variant.split("@")
    fields = CompilePolicy.__dataclass_fields__
    settings = {k: float(v) for k, v in (pair.split("=", 1) for pair in pairs) if k in fields}
    rules = [pair for pair in pairs if pair.split("=", 1)[0] not in fields]
    return common.variant_policy("@".join([name, *rules]), **backend, **settings)


def fit(args: argparse.Namespace, steady: int, profile: bool = False) -> Dict[str, Any]:
    """One fit of the model under the variant: the benchmark's clock, the callback and the profiler's result."""
    device, backend = common.device_for(args.smoke), {"backend": "aot_eager"} if args.smoke else {}
    torch.manual_seed(0)
    net = build(args.model, args.smoke)
    module = Plain(args.model, net)
    callback = None
    if args.variant == "compile_regions":
        from accelerate.utils import compile_regions

        module.net = compile_regions(net, **backend)
    else:
        callback = CompileCallback(variant_policy(args.variant, backend), print_plan=False)
    clock, until = StepClock(device), UntilSteady(callback, steady)
    profiler = StepProfiler(until, device, args.profile_steps) if profile else None
    callbacks = [clock, until, *([callback] if callback else []), *([profiler] if profiler else [])]
    trainer = common.quiet_trainer(device, precision="bf16-mixed", max_steps=args.max_steps, callbacks=callbacks)
    data = [tuple(t.to(device) for t in batch) for batch in batches(args.model, args.smoke, DISTINCT_BATCHES)]
    loader = torch.utils.data.DataLoader([data[i % len(data)] for i in range(args.max_steps)], batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    return dict(seconds=clock.timer.seconds(), callback=callback, until=until, profiler=profiler)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    run = fit(args, args.steady)
    seconds, callback, until = run["seconds"], run["callback"], run["until"]
    steady = seconds[until.first_steady :] if until.first_steady is not None else []
    step = statistics.median(steady or seconds[len(seconds) // 2 :])
    size = 4 if args.smoke else 64
    row = {"first_step_s": seconds[0], "step_ms": step * 1e3, "images_per_s": size / step, "steps_per_s": 1 / step}
    row |= {"steps": len(seconds), "error": None if steady else f"not steady after {len(seconds)} steps"}
    if callback is not None:
        summary = callback.summary()
        rate = next((summary[key] for key in SUMMARY_RATES if summary.get(key)), None)
        row |= {"summary_first_step_s": summary.get("first_step_time_s"), "summary_images_per_s": rate}
        row |= {"summary_steps_per_s": summary.get("steady_steps_per_s")}
        row["summary_vs_own"] = rate / row["images_per_s"] if rate else None
        row |= {key: summary.get(key) for key in ("background_eager_steps", "recompiles", "graph_breaks")}
        row |= {"graphs": summary.get("unique_graphs"), "plan": plan_of(callback)}
    return row


def plan_of(callback: CompileCallback) -> str:
    """``17 blocks in 5 entries (4 at the first step), 5 rest (background), 0 outer`` or ``whole``."""
    items = callback.applied.compiled if callback.applied is not None else []
    blocks = [item for item in items if item.region.role == "block"]
    if not blocks:
        return ", ".join(sorted({item.region.role for item in items})) or "nothing compiled"
    first = {item.entry_name for item in blocks if not item.region.background}
    rest = [item for item in items if item.region.role == "rest"]
    deferred = sum(item.region.background for item in rest)
    outer = sum(item.region.role == "outer" for item in items)
    entries = len({item.entry_name for item in blocks})
    return (
        f"{len(blocks)} blocks in {entries} entries ({len(first)} at the first step), {len(rest)} rest "
        f"({deferred} in the background), {outer} outer"
    )


class StepProfiler(pl.Callback):
    """Records ``steps`` training steps under torch.profiler once the fit is steady (``UntilSteady``)."""

    def __init__(self, until: UntilSteady, device: torch.device, steps: int) -> None:
        self.until, self.device, self.steps, self.profile, self.recorded = until, device, steps, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.profile is None and self.until.first_steady is not None and batch_idx >= self.until.first_steady:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.profile = torch.profiler.profile(activities=activities, record_shapes=False)
            common.synchronize(self.device)
            self.profile.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profile is not None and self.recorded < self.steps:
            self.recorded += 1
            if self.recorded == self.steps:
                common.synchronize(self.device)
                self.profile.__exit__(None, None, None)
                trainer.should_stop = True


def profile_measure(args: argparse.Namespace) -> Dict[str, Any]:
    """The profile of ``--profile-steps`` steady steps of one model and variant (``measure``'s row for a profile)."""
    run = fit(args, steady=args.profile_steps + 1, profile=True)
    profile = run["profiler"].profile
    if profile is None or run["profiler"].recorded < args.profile_steps:
        return {"error": f"no steady step profiled in {len(run['seconds'])} steps"}
    report = profile_report(profile, args.profile_steps, args.top)
    trace = args.out.with_name(f"{args.out.stem}.{args.model}.{args.variant}.trace.json")
    profile.export_chrome_trace(str(trace))
    with trace.open("rb") as plain, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    trace.unlink()
    return {"step_ms": report["step_ms"], "plan": plan_of(run["callback"]) if run["callback"] else None} | {
        "profile": report | {"trace": f"{trace}.gz"},
        "error": None,
    }


def profile_report(profile: Any, steps: int, top: int) -> Dict[str, Any]:
    """Per step: the top ops by self device time (self CPU time on a CPU), the layout conversions, the compiled
    regions' calls and CUDA-graph launches, and on a GPU its kernels' busy time against the step's span (the rest:
    the GPU waiting between the kernels, at graph boundaries and eager code)."""
    averages = profile.key_averages()
    on_device = any(getattr(a, "self_device_time_total", 0) for a in averages)
    own = (lambda a: a.self_device_time_total) if on_device else (lambda a: a.self_cpu_time_total)
    # on a GPU the kernels (and copies) alone: an op's or an annotation's device time is its kernels' again
    kernels = [a for a in averages if own(a) > 0 and (not on_device or _is_kernel(a))]
    rows = _per_step(sorted(kernels, key=own, reverse=True)[:top], own, steps)
    layout = [a for a in averages if a.key in LAYOUT_OPS]
    layout_ms = sum(a.device_time_total if on_device else a.cpu_time_total for a in layout) / 1e3 / steps
    moving = [a for a in kernels if on_device and any(word in a.key.lower() for word in LAYOUT_KERNELS)]
    moved = _per_step(sorted(moving, key=own, reverse=True), own, steps)
    regions = [a for a in averages if a.key.startswith(("Torch-Compiled Region", "CompiledFunction"))]
    launches = sum(a.count for a in averages if a.key == "cudaGraphLaunch") // steps
    busy, span = _kernel_time(profile)
    report = dict(top=rows, layout_ms=layout_ms, layout_calls=sum(a.count for a in layout) // steps)
    report |= dict(layout_kernels=moved[:top], layout_kernels_ms=sum(row["ms"] for row in moved))
    report |= dict(compiled_calls=sum(a.count for a in regions) // steps, cuda_graph_launches=launches)
    per_step = [value / 1e3 / steps if span else None for value in (busy, span, span - busy)]
    report |= dict(zip(("kernels_ms", "step_ms", "gpu_idle_ms"), per_step))
    lines = [f"{'op or kernel':<90} {'calls':>6} {'ms/step':>8}"]
    lines += [f"{row['name']:<90} {row['calls']:>6} {row['ms']:>8.3f}" for row in rows]
    timeline = "no GPU kernels" if not span else (
        f"{report['step_ms']:.2f} ms from the first kernel to the last, {report['kernels_ms']:.2f} ms in kernels, "
        f"{report['gpu_idle_ms']:.2f} ms idle between them"
    )  # fmt: skip
    lines.append(
        f"per step: {timeline}; {report['compiled_calls']} compiled-region calls, {launches} CUDA-graph launches; "
        f"layout conversions ({', '.join(LAYOUT_OPS)}): {report['layout_calls']} calls, {layout_ms:.2f} ms; "
        f"kernels that move layouts ({', '.join(LAYOUT_KERNELS)} in their names): {report['layout_kernels_ms']:.2f} ms"
    )
    lines += [f"  {row['name']:<88} {row['calls']:>6} {row['ms']:>8.3f}" for row in moved[:10]]
    return report | {"text": "\n".join(lines)}


def _is_kernel(average: Any) -> bool:
    return str(getattr(average, "device_type", "")).endswith("CUDA") and not average.key.startswith(ANNOTATIONS)


def _per_step(averages: List[Any], own: Any, steps: int) -> List[Dict[str, Any]]:
    return [dict(name=a.key[:90], calls=a.count // steps, ms=own(a) / 1e3 / steps) for a in averages]


def _kernel_time(profile: Any) -> tuple:
    """(µs the device ran kernels, µs from the first kernel's start to the last's end); (0, 0) without a GPU."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in profile.events()
        if _is_kernel(e) and e.time_range.end > e.time_range.start
    )
    busy, reached = 0.0, None
    for start, end in spans:
        start = max(start, reached) if reached is not None else start
        busy += max(end - start, 0)
        reached = max(end, reached or end)
    return busy, (spans[-1][1] - spans[0][0]) if spans else 0.0


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    models = [m for m in args.models.split(",") if m]
    profiles = [p.split(":", 1) for p in args.profile.split(",") if p]
    unknown = [m for m in models + [m for m, _ in profiles] if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    measured = [{"model": m, "variant": v} for m in models for v in args.variants.split(",") if v]
    return measured + [{"model": m, "variant": f"{v} (profile)", "_profiled": v} for m, v in profiles]


def ratios(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each row's first step and images/s against the faster whole-model compile of its model (``WHOLE``)."""
    for model in {row["model"] for row in rows}:
        whole = [r for r in rows if r["model"] == model and r["variant"] in WHOLE and r.get("images_per_s")]
        if not whole:
            continue
        base = max(whole, key=lambda r: r["images_per_s"])
        for row in rows:
            if row["model"] == model and row.get("images_per_s") and not row.get("error"):
                row["first_step_vs_full"] = row["first_step_s"] / base["first_step_s"]
                row["throughput_vs_full"] = row["images_per_s"] / base["images_per_s"]
    return rows


def measure_run(args: argparse.Namespace) -> Dict[str, Any]:
    if getattr(args, "profiled", None):
        args.variant = args.profiled
        return profile_measure(args)
    return measure(args)


def notes(args: argparse.Namespace, rows: List[Dict[str, Any]]) -> List[str]:
    """What a reader of the table should know, and each profile's report (printed at the end, kept in the result)."""
    profiles = [
        f"profile of {row['model']} under {row['variant']} ({row['profile']['trace']}):\n{row['profile']['text']}"
        for row in rows
        if row.get("profile")
    ]
    return [
        "timm models with their recipes' drop path (ConvNeXt-T, Swin-T 0.1, EfficientNet-B0 0.2, ViT-B/16 0.1, "
        "ResNet-50 none), random weights, a plain LightningModule fed (images, labels) tuples of 64 x 224 x 224, "
        "Trainer(precision='bf16-mixed'), fused AdamW; each variant a fresh process with empty compile caches.",
        f"step_ms: median of the {args.steady} steps after the compiled regions are in use (a background install) and "
        f"{INSTALL_STEPS} more that record CUDA graphs, by the benchmark's CUDA events around each training batch; "
        "*_vs_full: against the faster of the whole-model compiles (reduce_overhead, full) of the same model.",
        "summary_*: CompileCallback.summary() of the same run (its images/s from the first of "
        f"{', '.join(SUMMARY_RATES)} it reports); summary_vs_own: its images/s over the benchmark's (goal: within 5%).",
        "plan: the block regions, their compiled entries and how many compile at the first step; the rest regions "
        "and how many compile on the background thread; the outer regions.",
    ] + profiles


BENCHMARK = common.Benchmark(
    name="vision",
    title="timm's vision models as trained, through Lightning",
    columns=COLUMNS,
    runs=runs,
    measure=measure_run,
    shared=dict(timeout=420, repeats=1),
    options={
        "--models": dict(default=",".join(MODELS)),
        "--variants": dict(default="regional,reduce_overhead,compile_regions"),
        "--steady": dict(type=int, default=200, help="steps timed once the compiled regions are in use"),
        "--max-steps": dict(type=int, default=3000, help="steps at most (a background install comes first)"),
        "--profile": dict(default="", help="MODEL:VARIANT,...: profile steady steps of each instead"),
        "--profile-steps": dict(type=int, default=3, help="steps recorded by --profile"),
        "--top": dict(type=int, default=25, help="ops and kernels --profile prints"),
    },
    smoke=dict(steady=3, max_steps=12, timeout=300, profile_steps=1),
    finish=ratios,
    notes=notes,
    key=("model", "variant"),
    timed=("first_step_s", "step_ms", "images_per_s", "steps_per_s", "summary_first_step_s", "summary_images_per_s"),
    baseline="the faster whole-model compile of the same model (reduce_overhead or full)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
