"""``compile-trainer explain``: one training step under a compile policy, and what the compiler did.

The model is a recipe of ``conf/config.yaml`` (composed with Hydra's compose API, so every override
of ``train.py`` works here) or any importable LightningModule (``--module pkg.mod:Class``). Its batch
comes from ``--datamodule``, the module's own ``train_dataloader``, or its ``example_input_array``
(then the step is a forward and a backward of the output's sum, without a Trainer).
"""

from __future__ import annotations

import importlib
import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from compile_trainer.compiling.plan_table import format_plan_table
from compile_trainer.compiling.regions import apply_policy
from compile_trainer.lightning.callback import CompileCallback
from compile_trainer.schema import bundled_policy_dir
from compile_trainer.tables import plural
from compile_trainer.telemetry.compile_events import CompileTelemetry
from compile_trainer.telemetry.compile_report import format_compile_report

EXPLAIN_TELEMETRY = {"measure_flops": False, "print_summary": False}


class ExplainError(ValueError):
    """Bad input to ``explain``: what was wrong and what is valid."""


@dataclass
class Explanation:
    plan: str
    telemetry: CompileTelemetry
    model: str

    @property
    def graph_breaks(self) -> int:
        """Graph breaks that no `eager` rule of the policy declared."""
        return self.telemetry.totals()["graph_breaks"]

    def report(self) -> str:
        totals = self.telemetry.totals()
        verdict = (
            f"{plural(totals['graph_breaks'], 'graph break')}, {totals['declared_graph_breaks']} declared by eager "
            f"rules, {plural(totals['unique_graphs'], 'graph')} in {plural(totals['compiles'], 'compile')}, "
            f"{plural(totals['recompiles'], 'recompile')}, {plural(totals['eager_fallbacks'], 'frame')} fell back "
            "to eager"
        )
        return "\n".join(
            [self.plan, "", f"one training step of {self.model}:", format_compile_report(self.telemetry), verdict]
        )


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """``conf/config.yaml`` with ``overrides``, as ``train.py`` would see it."""
    from hydra import compose, initialize_config_dir

    from compile_trainer.runs.hydra_configs import register_configs, unknown_override_keys

    register_configs()
    unknown = unknown_override_keys(list(overrides), [bundled_policy_dir().parent])
    if unknown:
        raise ExplainError("\n".join(unknown))
    with initialize_config_dir(config_dir=str(bundled_policy_dir().parent), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def load_object(path: str, what: str) -> Any:
    """``pkg.module:Name`` -> the object it names."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ExplainError(f"--{what} {path!r}: give it as 'package.module:Name'.")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ExplainError(f"--{what} {path!r} cannot be imported: {error}") from error


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's banners and the telemetry's own log lines would repeat what the report says."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "compile_trainer")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def explain(
    overrides: Sequence[str] = (), module: Optional[str] = None, datamodule: Optional[str] = None, steps: int = 1
) -> Explanation:
    """Run ``steps`` training steps under the configured policy and collect what the compiler did."""
    if steps < 1:
        raise ExplainError(f"--steps must be >= 1, got {steps}.")
    cfg = compose_config(overrides)
    policy = OmegaConf.to_container(cfg.compile, resolve=True)
    callback = CompileCallback(policy=policy, print_plan=False, telemetry=EXPLAIN_TELEMETRY)
    pl.seed_everything(cfg.seed, verbose=False)
    if module is None:
        from hydra.utils import instantiate

        lightning_module, data = instantiate(cfg.recipe.module), instantiate(cfg.recipe.data)
    else:
        try:
            lightning_module = load_object(module, "module")()
        except TypeError as error:
            raise ExplainError(
                f"--module {module!r} cannot be made without arguments ({error}); name a function that returns it."
            ) from error
        if not isinstance(lightning_module, pl.LightningModule):
            raise ExplainError(f"--module {module!r} gave a {type(lightning_module).__name__}, not a LightningModule.")
        data = load_object(datamodule, "datamodule")() if datamodule else None
    name = type(lightning_module).__name__
    with _quiet_lightning():
        if data is None and not is_overridden("train_dataloader", lightning_module):
            return _explain_example_input(lightning_module, callback, name)
        return _explain_fit(cfg, lightning_module, data, callback, steps, name)


def _explain_fit(cfg: DictConfig, module: pl.LightningModule, data: Any, callback, steps: int, name: str):
    from hydra.utils import instantiate

    with tempfile.TemporaryDirectory(prefix="compile-trainer-explain-") as root:
        trainer: pl.Trainer = instantiate(
            cfg.trainer,
            logger=False,
            callbacks=[callback],
            max_steps=steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(module, datamodule=data)
    telemetry = callback.telemetry.compile
    telemetry.collect()
    return Explanation(format_plan_table(callback.applied), telemetry, name)


def _explain_example_input(module: pl.LightningModule, callback: CompileCallback, name: str) -> Explanation:
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ExplainError(
            f"{name} has no batches to explain: it defines neither train_dataloader nor example_input_array; "
            "pass --datamodule package.module:DataModule."
        )
    applied = apply_policy(module, callback.policy)
    telemetry = CompileTelemetry(applied, module).install()
    telemetry.phase = "example input"
    try:
        args, kwargs = _as_call(example)
        output = module(*args, **kwargs)
        loss = _first_tensor(output)
        if loss is not None and loss.requires_grad:
            loss.float().sum().backward()
        telemetry.collect()
    finally:
        telemetry.uninstall()
    return Explanation(format_plan_table(applied), telemetry, f"{name} (example_input_array)")


def _as_call(example: Any):
    if isinstance(example, dict):
        return (), example
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    values: List[Any] = list(output.values()) if isinstance(output, dict) else list(output or ())
    return next((value for value in values if isinstance(value, torch.Tensor)), None)
