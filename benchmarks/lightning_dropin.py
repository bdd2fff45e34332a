"""The callback dropped into a plain LightningModule, as a user runs it: ``Trainer(precision="bf16-mixed")``, fused
AdamW, no telemetry configuration. HF Llama (8 x 1024 tokens, a dict batch) and timm ViT-B/16 (64 images of 224²)
under eager, ``torch.compile`` by hand, and ``CompileCallback`` with ``regional``, ``regional_background`` and
``full``: the benchmark's own clock (CUDA events) beside the callback's summary. Then the compile cache through
``train.py`` (``gpt2_small``): ``cold`` writes the bundle, ``new_machine`` loads it with empty Inductor/Triton caches,
``full`` ``cold_no_cache`` is the base of ``vs_full_cold``. Each variant a fresh process with empty compile caches.

    python benchmarks/lightning_dropin.py --models llama --variants regional,full --cache-policies ''
    python benchmarks/lightning_dropin.py --models '' --cache-policies regional,full --timeout 150
    python benchmarks/lightning_dropin.py --smoke --out /tmp/dropin.json     # CPU, tiny models, aot_eager
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from operator import itemgetter
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.utilities import move_data_to_device  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import common, models  # noqa: E402
from compile_trainer import CompileCallback  # noqa: E402

CACHE_MODEL = {False: "gpt2_small (train.py)", True: "gpt_tiny (train.py, smoke)"}
COLUMNS = [
    "model", "variant", "first_step_s", "step_ms", "units", "per_s", "mfu", "summary_per_s", "summary_vs_own",
    "summary_mfu", "summary_mfu_vs_own", "summary_first_step_s", "vs_eager", "summary_speedup_vs_eager",
    "summary_speedup_vs_separate", "precompiled_served", "traced", "graphs",
    "eager_fallbacks", "failed_captures", "vs_full_cold", "error",
]  # fmt: skip


def build(name: str, smoke: bool) -> nn.Module:
    """The Llama of the regional benchmark (``real_models``), or timm's ViT-B/16 itself (no transformers stand-in)."""
    if name == "llama":
        return models.build_model("llama", smoke)[0]
    import timm

    tiny = models.TIMM_VIT_TINY if smoke else {}
    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000, **tiny)


INSTALL_STEPS = 2  # the steps after a background install that warm up and record CUDA graphs
DISTINCT_BATCHES = 64  # a longer run cycles through them (64 ViT batches are 2.5 GB on the host)


def batches(name: str, smoke: bool, count: int) -> List[Any]:
    """``count`` batches, of which at most ``DISTINCT_BATCHES`` distinct ones, in turn."""
    distinct = distinct_batches(name, smoke, min(count, DISTINCT_BATCHES))
    return [distinct[index % len(distinct)] for index in range(count)]


def distinct_batches(name: str, smoke: bool, count: int) -> List[Any]:
    generator = torch.Generator().manual_seed(0)
    if name == "llama":
        size, length, vocab = (2, 32, 256) if smoke else (8, 1024, 32000)
        ids = [torch.randint(0, vocab, (size, length), generator=generator) for _ in range(count)]
        return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    size, side = (4, 32) if smoke else (64, 224)
    images = [torch.randn(size, 3, side, side, generator=generator) for _ in range(count)]
    return [(x, torch.randint(0, 1000, (size,), generator=generator)) for x in images]


class Plain(pl.LightningModule):
    """A plain LightningModule, as a user writes it: nothing for the callback's sake."""

    def __init__(self, model: str, net: nn.Module) -> None:
        super().__init__()
        self.model_name, self.net = model, net

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if self.model_name == "llama":
            return self.net(**batch).loss
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")


class StepClock(pl.Callback):
    """Times each training step on the device's timeline (``StepTimer``: CUDA events on a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.timer, self.started = common.StepTimer(device), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started = self.timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.timer.stop(self.started)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    device, backend = common.device_for(args.smoke), {"backend": "aot_eager"} if args.smoke else {}
    torch.manual_seed(0)
    net = build(args.model, args.smoke)
    data = batches(args.model, args.smoke, args.steps)
    module = Plain(args.model, net.to(device))
    first = move_data_to_device(data[0], device)
    flops = models.count_flops(net, lambda: module.training_step(first, 0), device)
    callback = CompileCallback(args.variant, **backend) if args.variant not in ("eager", "by_hand") else None
    if args.variant == "by_hand":
        module.net = torch.compile(net, **backend)
    clock = StepClock(device)
    callbacks = [clock] + ([callback] if callback else [])
    trainer = common.quiet_trainer(device, precision="bf16-mixed", max_steps=args.steps, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    seconds = clock.timer.seconds()
    summary = callback.summary() if callback is not None else {}
    # The second half (past compiles and recordings), or the steps after a background compile's install and the
    # CUDA-graph warm-up and recording it starts, where those came later (a 1,000-step ViT installed at step 749).
    # The callback's eager reference steps come first (telemetry.eager_reference_steps): the compile step follows them.
    reference = summary.get("eager_steps") or 0
    steady_from = max(len(seconds) // 2, reference + (summary.get("background_eager_steps") or 0) + INSTALL_STEPS)
    step = statistics.median(seconds[steady_from:] or seconds[len(seconds) // 2 :])
    tokens = args.model == "llama"
    per_step = data[0]["input_ids"].numel() if tokens else data[0][0].shape[0]
    row = {"model": args.model, "variant": args.variant, "first_step_s": seconds[reference], "step_ms": step * 1e3}
    row |= {"units": "tokens" if tokens else "images", "per_s": per_step / step, "error": None}
    row |= common.flop_rates(flops, step, device)
    if callback is not None:
        own, mfu = summary.get("steady_items_per_s" if tokens else "steady_samples_per_s"), summary.get("mfu")
        row |= {"summary_per_s": own, "summary_mfu": mfu, "summary_first_step_s": summary.get("first_step_time_s")}
        row["summary_vs_own"] = own / row["per_s"] if own else None
        row["summary_mfu_vs_own"] = mfu / row["mfu"] if mfu and row["mfu"] else None
        row["summary_speedup_vs_eager"] = summary.get("speedup_vs_eager")
        row |= {key: value for key, value in summary.items() if key.startswith("background_")}
    return row


def finish(rows: List[Dict[str, Any]], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The cache rows' first step over full's with no cache; each variant's speed-up over the separate eager run of
    its model, and the callback's own speed-up (its eager reference steps in the same fit) against that."""
    common.add_ratio(
        rows, "vs_full_cold", "first_step_s", lambda row: row["variant"] == "full cold_no_cache", itemgetter("model")
    )
    common.add_ratio(rows, "vs_eager", "step_ms", lambda row: row["variant"] == "eager", itemgetter("model"), True)
    for row in rows:
        if row.get("summary_speedup_vs_eager") and row.get("vs_eager"):
            row["summary_speedup_vs_separate"] = row["summary_speedup_vs_eager"] / row["vs_eager"]
    return rows


def train_py(args: argparse.Namespace) -> Dict[str, Any]:
    """One ``train.py`` run of the recipe (this process's Inductor and Triton caches are ``run_fresh``'s), its
    row read from the run's ``result.json``."""
    policy, phase = args.cache_run.split(":")
    recipe = ["recipe=gpt_tiny", "trainer.accelerator=cpu", "compile.backend=aot_eager"] if args.smoke else []
    overrides = recipe or ["recipe=gpt2_small", "trainer=gpu"]
    overrides += [f"compile={policy}", "logger=csv", f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0"]
    overrides += [f"compile.cache.dir={args.bundle}"] if phase != "cold_no_cache" else []
    with tempfile.TemporaryDirectory(prefix="train-py-") as run_dir:
        command = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        result_file = Path(run_dir) / "result.json"
        if done.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"train.py exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
        summary = json.loads(result_file.read_text())["summary"]
    skipped = summary.get("cache_precompiled_skipped") or {}
    return {
        "model": CACHE_MODEL[args.smoke],
        "variant": f"{policy} {phase}",
        "first_step_s": summary.get("first_step_time_s"),
        "step_ms": median * 1e3 if (median := summary.get("steady_step_time_median_s")) else None,
        "precompiled_served": summary.get("cache_precompiled_hits"),
        "traced": summary.get("cache_precompiled_misses"),
        "graphs": summary.get("unique_graphs"),
        "eager_fallbacks": summary.get("eager_fallbacks"),
        "failed_captures": len(skipped),
        "error": None,
    }


def runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each model under each variant; then each cache policy cold and on a new machine (one bundle directory),
    and ``full`` with no cache, the base of ``vs_full_cold``."""
    policies = [p for p in args.cache_policies.split(",") if p]
    model_names = [m for m in args.models.split(",") if m]
    cache_runs = [(p, phase) for p in policies for phase in ("cold", "new_machine")] + [("full", "cold_no_cache")]
    return [{"model": m, "variant": v} for m in model_names for v in args.variants.split(",")] + [
        {"model": CACHE_MODEL[args.smoke], "variant": f"{policy} {phase}", "_cache_run": f"{policy}:{phase}"}
        | {"_bundle": str(args.scratch / (policy if phase != "cold_no_cache" else "none"))}
        for policy, phase in (cache_runs if policies else [])
    ]


BENCHMARK = common.Benchmark(
    name="lightning_dropin",
    title="The callback dropped into a plain LightningModule",
    columns=COLUMNS,
    runs=runs,
    measure=lambda args: train_py(args) if getattr(args, "cache_run", None) else measure(args),
    shared=dict(steps=50, timeout=240),
    options={
        "--models": dict(default="llama,vit"),
        "--variants": dict(default="eager,by_hand,regional,regional_background,full"),
        "--cache-policies": dict(default="regional,full", help="train.py cache runs ('' for none)"),
    },
    smoke=dict(steps=4),
    finish=finish,
    notes=lambda args, rows: [
        "A plain LightningModule, Trainer(precision='bf16-mixed'), fused AdamW on the GPU; each variant a fresh "
        "process with empty compile caches.",
        "step_ms: median of the second half of the steps, or of those after a background compile's install and the 2 "
        "that warm up and record its CUDA graphs where they came later (the benchmark's own CUDA events around each "
        "training batch);"
        " per_s and mfu from it (FLOPs: FlopCounterMode on the eager model, GQA attention counted as its kernels do).",
        "summary_*: CompileCallback.summary() of the same run, with no telemetry configured; *_vs_own: its ratio to "
        "the benchmark's own figure (goal: within 5%). vs_eager: the separate eager run's step over this one's; "
        "summary_speedup_vs_separate: the callback's speedup_vs_eager (its eager reference steps) over vs_eager "
        "(goal: within 10%). first_step_s: the step that compiles, after the callback's eager reference steps.",
        "gpt2_small (train.py): the recipe through train.py (trainer=gpu: bf16-mixed), each run a fresh process; "
        "new_machine loads the cold run's bundle with empty Inductor and Triton caches; precompiled_served / traced: "
        "region calls the precompiled layer served / that Dynamo traced instead; vs_full_cold: the first step "
        "against full's cold_no_cache (goal: <= 0.03 on a new machine, with 0 traced, 0 fallbacks, 0 failed "
        "captures).",
    ],
    key=("model", "variant"),
    baseline="the benchmark's own clock (summary_*_vs_own)",
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
