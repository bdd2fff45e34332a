"""The recipe LightningModule's own behaviour: what it logs as the training loss."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from compile_trainer_recipes.gpt import LanguageModel
from tests.conftest import quiet_cpu_trainer

MODEL = {"vocab_size": 64, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}


class MemoryLogger(Logger):
    """A Lightning logger that keeps what the Trainer writes, by step."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class StepLosses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def batches(count=6):
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, 64, (2, 2, 8), generator=generator)) for _ in range(count)]


def fit_and_log(every_step: bool, log_every: int, accumulate: int = 1):
    torch.manual_seed(0)
    module = LanguageModel(model=MODEL, warmup_steps=1, log_loss_every_step=every_step)
    logger, losses = MemoryLogger(), StepLosses()
    trainer = quiet_cpu_trainer(
        max_steps=6 // accumulate,
        logger=logger,
        log_every_n_steps=log_every,
        accumulate_grad_batches=accumulate,
        callbacks=[losses],
    )
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    logged = {step: metrics["train/loss"] for step, metrics in logger.rows if "train/loss" in metrics}
    return logged, losses.losses


def test_train_loss_is_the_mean_over_each_logging_interval():
    logged, losses = fit_and_log(every_step=False, log_every=3)
    assert sorted(logged) == [2, 5], "written on the logger's steps only"
    assert logged[2] == pytest.approx(sum(losses[:3]) / 3, rel=1e-6)
    assert logged[5] == pytest.approx(sum(losses[3:]) / 3, rel=1e-6)


def test_train_loss_of_every_step_when_asked():
    logged, losses = fit_and_log(every_step=True, log_every=1)
    assert [logged[step] for step in sorted(logged)] == pytest.approx(losses, rel=1e-6)


def test_train_loss_interval_counts_every_micro_batch_under_gradient_accumulation():
    logged, losses = fit_and_log(every_step=False, log_every=3, accumulate=2)
    assert sorted(logged) == [2], "optimizer steps 0-2 are one interval"
    # Lightning hands callbacks each micro-batch's loss divided by the accumulation factor
    assert logged[2] == pytest.approx(sum(loss * 2 for loss in losses) / 6, rel=1e-6)
