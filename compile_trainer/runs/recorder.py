"""The runs of a sweep (``python train.py -m ...``): each run's result file, W&B group and score.

``RunRecorder`` wraps a whole run in ``compile_trainer.runs.training.train``: when the run ends, finished or
failed, it writes ``result.json`` (``compile_trainer.runs.results``) in the run directory; a failure is raised
again afterwards, so Hydra's multirun goes on with the other runs and reports the failure at the end.
``sweeper_value`` is what ``train.py`` returns to Hydra's sweeper (Optuna maximizes or minimizes it).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from compile_trainer import compat
from compile_trainer.runs.results import OBJECTIVES, device_description, objective_value, versions, write_result
from compile_trainer.schema import policy_to_dict, to_sweep_settings

log = logging.getLogger(__name__)

TRAIN_LOSS_KEYS = ("train/loss", "train_loss", "loss")
VAL_LOSS_KEYS = ("val/loss", "val_loss")
# Recipe data settings that change how fast batches come, never which batches come in which order.
DATA_LOADING_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def compile_cache(fresh: bool) -> ContextManager[None]:
    """Empty Inductor/Triton caches for the duration (``fresh``), or the environment's caches."""
    if not fresh:
        return contextlib.nullcontext()
    return compat.fresh_inductor_cache()


@dataclass
class HydraRun:
    """Where a run sits in Hydra's world: its directory, overrides and, in a multirun, its sweep and job."""

    output_dir: Path
    overrides: List[str]
    multirun: bool
    sweep_dir: Optional[str] = None
    job: Optional[int] = None

    @staticmethod
    def current() -> HydraRun:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        return HydraRun(
            output_dir=Path(hydra_cfg.runtime.output_dir),
            overrides=list(hydra_cfg.overrides.task),
            multirun=multirun,
            sweep_dir=str(hydra_cfg.sweep.dir) if multirun else None,
            job=int(hydra_cfg.job.num) if multirun else None,
        )


def _first(metrics: Dict[str, Any], keys: tuple) -> Optional[float]:
    return next((float(metrics[key]) for key in keys if key in metrics), None)


def _error(error: BaseException) -> Dict[str, str]:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return {"type": type(error).__name__, "message": str(error), "traceback": "".join(lines)[-6000:]}


class RunRecorder:
    """Collects one run's result and writes ``result.json`` when the run ends; see the module docstring.

    Set ``callback`` and ``trainer`` as they are made. Runs of a multirun share one process, so each
    starts with Dynamo's caches cleared (no run reuses, or recompiles, another run's compiled code) and
    the previous run's memory freed.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.settings = to_sweep_settings(cfg.get("sweep"))
        self.hydra = HydraRun.current()
        self.callback: Optional[Any] = None
        self.trainer: Optional[pl.Trainer] = None
        self.result: Dict[str, Any] = {}
        self._started = time.perf_counter()
        self._started_at = datetime.now(UTC).isoformat(timespec="seconds")

    def __enter__(self) -> RunRecorder:
        torch.compiler.reset()
        gc.collect()  # the previous run's model and optimizer (Trainer and module refer to each other)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # its cached blocks too: each run's peak memory is its own
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> bool:
        self.result = self.collect(error)
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if rank == 0 or error is not None:  # the ranks share the run directory: rank 0's file, another's failure
            path = write_result(self.hydra.output_dir, self.result, rank)
            log.info("run result (%s) written to %s", self.result["status"], path)
        return False  # a failure propagates

    @property
    def sweep_name(self) -> Optional[str]:
        """The name of the run's sweep (``None`` outside a multirun)."""
        return (self.settings.name or Path(self.hydra.sweep_dir).name) if self.hydra.multirun else None

    def identity(self) -> Dict[str, Any]:
        """The run's name in its sweep, for the logger's hyperparameters."""
        return {
            "policy": self.cfg.compile.get("name"),
            "sweep": self.sweep_name,
            "job": self.hydra.job,
            "overrides": self.hydra.overrides,
        }

    def logger_overrides(self, logger_cfg: DictConfig) -> Dict[str, Any]:
        """In a multirun, W&B runs share a group named after the sweep and are named ``<name>-<job>``."""
        from hydra.utils import get_class
        from lightning.pytorch.loggers import WandbLogger

        if not self.hydra.multirun or not issubclass(get_class(logger_cfg._target_), WandbLogger):
            return {}
        overrides: Dict[str, Any] = {"name": f"{logger_cfg.get('name') or 'run'}-{self.hydra.job}"}
        if not logger_cfg.get("group"):
            overrides["group"] = self.sweep_name
        return overrides

    def _policy_settings(self) -> Dict[str, Any]:
        if self.callback is not None:
            return policy_to_dict(self.callback.policy)
        return OmegaConf.to_container(self.cfg.compile, resolve=True)  # the policy did not validate

    def _device(self) -> Optional[Dict[str, Any]]:
        return device_description(self.trainer.strategy.root_device) if self.trainer is not None else None

    def _summary(self, failed: bool) -> Dict[str, Any]:
        if self.callback is None:
            return {}
        try:
            return self.callback.summary()
        except Exception as error:  # the run failed half-way: keep its error, not this one
            if not failed:
                raise
            log.warning("no telemetry summary for the failed run (%s)", error)
            return {}

    def collect(self, error: Optional[BaseException] = None) -> Dict[str, Any]:
        recipe = self.cfg.recipe
        data = OmegaConf.to_container(recipe.data, resolve=True)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()} if self.trainer else {}
        result = {
            "status": "failed" if error is not None else "ok",
            "error": _error(error) if error is not None else None,
            "policy": self.cfg.compile.get("name"),
            "policy_settings": self._policy_settings(),
            "overrides": self.hydra.overrides,
            "sweep": {"name": self.sweep_name, "dir": self.hydra.sweep_dir, "job": self.hydra.job}
            if self.hydra.multirun
            else None,
            "summary": self._summary(failed=error is not None),
            "final_train_loss": _first(metrics, TRAIN_LOSS_KEYS),
            "final_val_loss": _first(metrics, VAL_LOSS_KEYS),
            "seed": self.cfg.seed,
            "max_steps": OmegaConf.select(self.cfg, "trainer.max_steps"),
            "steps": self.trainer.global_step if self.trainer else 0,
            "recipe": recipe.get("name"),
            "data": {k: v for k, v in data.items() if k not in DATA_LOADING_KEYS},
            "model": OmegaConf.to_container(recipe.module, resolve=True),
            "precision": str(self.trainer.precision) if self.trainer else None,
            "world_size": self.trainer.world_size if self.trainer else None,
            "strategy": self.callback.strategy if self.callback else None,
            "fresh_cache": self.settings.fresh_cache,
            "environment": {"device": self._device(), "versions": versions()},
            "started_at": self._started_at,
            "wall_time_s": time.perf_counter() - self._started,
        }
        result["objective"] = self._objective(result) if error is None else None
        return result

    def _objective(self, result: Dict[str, Any]) -> Dict[str, Any]:
        settings = self.settings
        compile_time = result["summary"].get("compile_time_s")
        budget = settings.compile_time_budget_s
        return {
            "name": settings.objective,
            "maximize": OBJECTIVES[settings.objective].maximize,
            "value": objective_value(result, settings.objective),
            "compile_time_budget_s": budget,
            "within_budget": budget is None or (compile_time is not None and compile_time <= budget),
        }


def sweeper_value(result: Dict[str, Any]) -> float:
    """What ``train.py`` returns to Hydra's sweeper: the objective, its worst value when over the compile-time
    budget, NaN when unknown (Optuna then marks the trial failed)."""
    objective = result["objective"]
    if not objective["within_budget"]:
        return float("-inf") if objective["maximize"] else float("inf")
    return float("nan") if objective["value"] is None else float(objective["value"])
