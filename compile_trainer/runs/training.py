"""Run one training job from a composed Hydra config (what ``train.py`` calls)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from compile_trainer.lightning.callback import CompileCallback
from compile_trainer.lightning.strategies import refuse_before_launch
from compile_trainer.runs.recorder import RunRecorder, compile_cache
from compile_trainer.runs.results import distributed_metrics

log = logging.getLogger(__name__)


def build_callback(cfg: DictConfig) -> CompileCallback:
    telemetry = OmegaConf.to_container(cfg.telemetry, resolve=True) if "telemetry" in cfg else True
    return CompileCallback(policy=OmegaConf.to_container(cfg.compile, resolve=True), telemetry=telemetry)


def check_strategy(cfg: DictConfig, callback: CompileCallback) -> None:
    """The trainer's strategy and the policy checked together before any rank starts (``refuse_before_launch``)."""
    strategy = cfg.trainer.get("strategy")
    if isinstance(strategy, DictConfig) and "_target_" in strategy:
        strategy = instantiate(strategy)
    refuse_before_launch(strategy, callback.policy)


def train(cfg: DictConfig) -> Dict[str, Any]:
    """Fit the configured recipe under the configured compile policy; return the run's result.

    The result (``compile_trainer.results``) is also written to ``result.json`` in the run directory, and
    a run that fails writes one too (status ``failed``, with the error) before the error propagates.
    """
    recorder = RunRecorder(cfg)
    with recorder:
        callback = recorder.callback = build_callback(cfg)  # validates the policy before anything heavy happens
        check_strategy(cfg, callback)
        pl.seed_everything(cfg.seed, workers=True)
        module = instantiate(cfg.recipe.module)
        data = instantiate(cfg.recipe.data)
        logger = instantiate(cfg.logger, **recorder.logger_overrides(cfg.logger))
        logger.log_hyperparams({"config": OmegaConf.to_container(cfg, resolve=True), "run": recorder.identity()})
        trainer: pl.Trainer = instantiate(cfg.trainer, logger=logger, callbacks=[callback])
        recorder.trainer = trainer
        logger.log_hyperparams({"world_size": trainer.world_size})
        try:
            with compile_cache(recorder.settings.fresh_cache):
                trainer.fit(module, datamodule=data)
            ranks = distributed_metrics(callback.summary())
            if ranks:  # after fit: the logger was finalized, save() writes them
                logger.log_metrics(ranks, step=trainer.global_step)
                logger.save()
            if cfg.save_checkpoint:
                path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
                trainer.save_checkpoint(path)
                log.info("checkpoint saved to %s", path)
        finally:
            if isinstance(logger, WandbLogger):
                logger.experiment.finish()
    return recorder.result
