"""The callback dropped into a plain LightningModule, as a user runs it: ``Trainer(precision="bf16-mixed")``, fused
AdamW, no telemetry configuration. HF Llama (16 layers, d 1024, ``use_cache=False``, batch 8 x 1024; a dict batch
with ``input_ids``, ``attention_mask`` and ``labels``) and timm ViT-B/16 (batch 64 x 224²), each under: eager, the
inner model ``torch.compile``d by hand, and ``CompileCallback`` with ``regional``, ``regional_background`` and
``full``. Each variant is a fresh process with empty Inductor and Triton caches.

Per row: the first step and the median steady step (the benchmark's own CUDA-event clock), tokens/s or images/s
and MFU from them (FLOPs counted once per model by ``FlopCounterMode`` on the eager model), and next to them the
callback's summary figures (``steady_items_per_s`` or ``steady_samples_per_s``, ``mfu``), with their ratio.

    python benchmarks/lightning_dropin.py --out benchmarks/results/lightning_dropin.json
    python benchmarks/lightning_dropin.py --smoke --out /tmp/dropin.json     # CPU, tiny models, aot_eager

Importable without hydra and wandb (the GPU image has neither; omegaconf is carried).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    PEAK_BF16_FLOPS,
    StepTimer,
    print_table,
    quiet_trainer,
    run_fresh,
    worker,
    write_result,
)
from benchmarks.real_models import WithLoss, build_model, count_flops  # noqa: E402

MODELS = ("llama", "vit")
VARIANTS = ("eager", "by_hand", "regional", "regional_background", "full")
COLUMNS = [
    "model", "variant", "first_step_s", "step_ms", "units", "per_s", "mfu", "summary_per_s", "summary_vs_own",
    "summary_mfu", "summary_mfu_vs_own", "summary_first_step_s", "error",
]  # fmt: skip


def build(name: str, smoke: bool) -> nn.Module:
    """The Llama of the regional benchmark (``real_models``), or timm's ViT-B/16 itself (no transformers stand-in)."""
    if name == "llama":
        return build_model("llama", smoke)[0]
    import timm

    tiny = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2) if smoke else {}
    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000, **tiny)


def batches(name: str, smoke: bool, count: int) -> List[Any]:
    generator = torch.Generator().manual_seed(0)
    if name == "llama":
        size, length, vocab = (2, 32, 256) if smoke else (8, 1024, 32000)
        ids = [torch.randint(0, vocab, (size, length), generator=generator) for _ in range(count)]
        return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    size, side = (4, 32) if smoke else (64, 224)
    images = [torch.randn(size, 3, side, side, generator=generator) for _ in range(count)]
    return [(x, torch.randint(0, 1000, (size,), generator=generator)) for x in images]


def make_module(name: str, net: nn.Module) -> Any:
    """A plain LightningModule, as a user writes it: nothing for the callback's sake."""
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            if name == "llama":
                return self.net(**batch).loss
            images, labels = batch
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")

    return Plain()


def step_clock(device: torch.device) -> Any:
    """A callback timing each training step on the device's timeline (``StepTimer``: CUDA events on a GPU)."""
    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.timer, self.started = StepTimer(device), None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.started = self.timer.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.timer.stop(self.started)

    return StepClock()


def measure(args: argparse.Namespace) -> Dict[str, Any]:

    from compile_trainer import CompileCallback

    on_gpu = torch.cuda.is_available() and not args.smoke
    torch.manual_seed(0)
    net = build(args.model, args.smoke)
    data = batches(args.model, args.smoke, args.steps)
    device = torch.device("cuda" if on_gpu else "cpu")
    # real_models' FLOP count: a language model takes its ids as labels, a classifier (images, labels) with its loss
    if args.model == "llama":
        flops = count_flops("lm", net.to(device), data[0]["input_ids"].to(device), autocast=on_gpu)
    else:
        images, labels = (t.to(device) for t in data[0])
        flops = count_flops("image", WithLoss(net).to(device), (images, labels), autocast=on_gpu)
    callbacks: List[Any] = []
    compile_callback = None
    if args.variant == "by_hand":
        net = torch.compile(net, **({"backend": "aot_eager"} if args.smoke else {}))
    elif args.variant != "eager":
        compile_callback = CompileCallback(args.variant, **({"backend": "aot_eager"} if args.smoke else {}))
        callbacks.append(compile_callback)
    clock = step_clock(device)
    trainer = quiet_trainer(device, precision="bf16-mixed", max_steps=args.steps, callbacks=[clock, *callbacks])
    trainer.fit(make_module(args.model, net), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    seconds = clock.timer.seconds()
    step = statistics.median(seconds[len(seconds) // 2 :])  # the second half: past compiles and recordings
    units = "tokens" if args.model == "llama" else "images"
    per_step = data[0]["input_ids"].numel() if args.model == "llama" else data[0][0].shape[0]
    peak = next((p for key, p in PEAK_BF16_FLOPS.items() if on_gpu and key in torch.cuda.get_device_name()), None)
    row = {"model": args.model, "variant": args.variant, "first_step_s": seconds[0], "step_ms": step * 1e3}
    row |= {"units": units, "per_s": per_step / step, "mfu": flops / step / peak if peak else None, "error": None}
    if compile_callback is not None:
        summary = compile_callback.summary()
        own = summary.get("steady_items_per_s") if units == "tokens" else summary.get("steady_samples_per_s")
        row |= {"summary_per_s": own, "summary_mfu": summary.get("mfu")}
        row |= {"summary_first_step_s": summary.get("first_step_time_s")}
        row["summary_vs_own"] = own / row["per_s"] if own else None
        row["summary_mfu_vs_own"] = summary["mfu"] / row["mfu"] if summary.get("mfu") and row["mfu"] else None
    return row


def run_variant(args: argparse.Namespace, model: str, variant: str) -> Dict[str, Any]:
    command = ["--worker", "--model", model, "--variant", variant, "--steps", str(args.steps)]
    result = run_fresh(__file__, command + ["--smoke"] * args.smoke, args.timeout)
    result.pop("process_s")
    return result if not result.get("error") else {"model": model, "variant": variant, "error": result["error"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lightning_dropin.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, backend aot_eager")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="training steps a variant (50; 4 with --smoke)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds a variant may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.smoke else 50)
    if args.worker:
        return worker(args.worker_out, lambda: measure(args), args.timeout)
    rows = [run_variant(args, m, v) for m in args.models.split(",") for v in args.variants.split(",")]
    notes = [
        "A plain LightningModule, Trainer(precision='bf16-mixed'), fused AdamW on the GPU; each variant a fresh "
        "process with empty compile caches.",
        "step_ms: median of the second half of the steps (the benchmark's own CUDA events around each training batch);"
        " per_s and mfu from it (FLOPs: FlopCounterMode on the eager model, GQA attention counted as its kernels do).",
        "summary_*: CompileCallback.summary() of the same run, with no telemetry configured; *_vs_own: its ratio to "
        "the benchmark's own figure (goal: within 5%).",
    ]
    write_result(
        Path(args.out), "lightning_dropin", "The callback dropped into a plain LightningModule", COLUMNS, rows, notes
    )
    print_table(COLUMNS, rows, baseline="the benchmark's own clock (summary_*_vs_own)")


if __name__ == "__main__":
    main()
