"""An image classifier as people train one, in a plain LightningModule, with compile_trainer's callback.

A ConvNeXt from transformers, built from a config (random weights, nothing is downloaded) the way its recipe trains
it: stochastic depth rising to ``drop_path_rate`` 0.1 over the blocks, stages of different widths, each repeating
one block. A ``torchmetrics`` accuracy is updated and logged in ``training_step``. The images are generated here:
a disc, a square or a ring of random colour, size and place on a noisy background; the class is the shape.

    python docs/examples/vision_classifier.py                  # CPU: regional, Inductor
    python docs/examples/vision_classifier.py --policy none    # the eager baseline, with the same telemetry
    python docs/examples/vision_classifier.py --image-size 224 --depths 3 3 9 3 --widths 96 192 384 768 \\
        --batch-size 64 --lr 5e-4 --precision bf16-mixed       # a GPU: ConvNeXt-T's shape

``regional`` finds the repeated blocks inside the stages (their widths differ, the blocks within one do not) and
compiles one graph per stage for them (and one for the very first block, whose drop path is off), passing each
block's drop-path probability to its graph as an input: 5 graphs for 18 blocks.
"""

import argparse

import lightning.pytorch as pl
import torch
import torchmetrics
import transformers
from torch.utils.data import DataLoader, TensorDataset

from compile_trainer import CompileCallback

SHAPES = ("disc", "square", "ring")


def shapes_dataset(count: int, size: int, seed: int) -> TensorDataset:
    """``count`` images (3 x size x size) of one shape each, and the shape's index as the label."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (count,), generator=generator)
    radius = size * (0.12 + 0.18 * torch.rand(count, 1, 1, generator=generator))
    cx, cy = (radius + (size - 2 * radius) * torch.rand(2, count, 1, 1, generator=generator)).unbind(0)
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    dx, dy = x - cx, y - cy
    distance = (dx**2 + dy**2).sqrt()
    masks = torch.stack(
        [
            distance < radius,
            (dx.abs() < radius * 0.85) & (dy.abs() < radius * 0.85),
            (distance < radius) & (distance > radius * 0.6),
        ],
        dim=1,
    )[torch.arange(count), labels]
    colour = torch.rand(count, 3, 1, 1, generator=generator)
    images = 0.1 * torch.randn(count, 3, size, size, generator=generator) + masks[:, None] * (0.5 + colour) * 2
    return TensorDataset(images, labels)


class Classifier(pl.LightningModule):
    def __init__(self, depths, widths, lr: float):
        super().__init__()
        config = transformers.ConvNextConfig(
            depths=list(depths), hidden_sizes=list(widths), drop_path_rate=0.1, num_labels=len(SHAPES)
        )
        self.model = transformers.ConvNextForImageClassification(config)
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=len(SHAPES))
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=len(SHAPES))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        images, labels = batch
        output = self.model(pixel_values=images, labels=labels)
        self.train_accuracy(output.logits, labels)
        self.log_dict({"train/loss": output.loss, "train/acc": self.train_accuracy}, prog_bar=True)
        return output.loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.val_accuracy(self.model(pixel_values=images).logits, labels)
        self.log("val/acc", self.val_accuracy)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, self.lr, self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="regional", help="a bundled policy (conf/compile/) or a YAML file")
    parser.add_argument("--backend", default=None, help="e.g. eager or aot_eager to check the plan in seconds")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--depths", type=int, nargs=4, default=[3, 3, 9, 3])
    parser.add_argument("--widths", type=int, nargs=4, default=[16, 32, 64, 128])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3, help="OneCycle's peak")
    parser.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed, 16-mixed")
    parser.add_argument("--out", default="outputs/examples/vision_classifier")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = Classifier(args.depths, args.widths, args.lr)
    train = DataLoader(shapes_dataset(args.images, args.image_size, 0), args.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(shapes_dataset(args.batch_size * 8, args.image_size, 1), args.batch_size)
    overrides = {"backend": args.backend} if args.backend else {}
    callback = CompileCallback(args.policy, **overrides)
    trainer = pl.Trainer(
        max_steps=args.steps, precision=args.precision, callbacks=[callback], default_root_dir=args.out,
        val_check_interval=min(100, args.steps), check_val_every_n_epoch=None, log_every_n_steps=10,
    )  # fmt: skip
    trainer.fit(model, train, val)
    summary = callback.summary()
    metrics = trainer.callback_metrics
    print(
        f"train/acc {float(metrics['train/acc']):.3f}, val/acc {float(metrics['val/acc']):.3f}; first step "
        f"{summary['first_step_time_s']:.1f} s, {summary['recompiles']} recompiles, {summary['graph_breaks']} graph "
        "breaks"
    )


if __name__ == "__main__":
    main()
