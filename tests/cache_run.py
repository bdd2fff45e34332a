"""One training run under a compile cache, as a fresh process (a "new machine" when the test gives it empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR). Prints the run's summary as JSON on its last line.

    python tests/cache_run.py CACHE_DIR [--wandb-dir DIR] [--mode read-write] [--layers mega_cache cache_dirs]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from telemetry_models import TinyRegression  # noqa: E402

from compile_trainer import CompileCallback  # noqa: E402

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--mode", default="read-write")
    parser.add_argument("--wandb-dir")
    parser.add_argument("--layers", nargs="+", help="the bundle layers to use (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = {"dir": args.cache_dir, "mode": args.mode} | ({"layers": args.layers} if args.layers else {})
    callback = CompileCallback("regional", backend="inductor", cache=cache, telemetry={"measure_flops": False})
    logger = False
    if args.wandb_dir:
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="cache", save_dir=args.wandb_dir, offline=True)
    module = TinyRegression(n_batches=STEPS)
    trainer = pl.Trainer(
        max_steps=STEPS, logger=logger, callbacks=[callback], accelerator="cpu", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module)
    if args.wandb_dir:
        logger.experiment.finish()
    regions = {label: [s.cache_hits, s.cache_misses] for label, s in callback.telemetry.compile.regions.items()}
    loss = float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))))
    weights = [p.detach().sum().item() for p in module.parameters()]
    print(json.dumps({**callback.summary(), "regions": regions, "loss": loss, "weights": weights}))


if __name__ == "__main__":
    main()
