"""``CompileCallback``: applies a compile policy to a LightningModule inside a Lightning Trainer.

It only wires the library's parts to Lightning's hooks; everything it does can be called without
Lightning (``to_policy``, ``apply_policy``, ``format_plan_table``, ``BatchShaper``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from compile_trainer.apply import APPLIED_ATTR, AppliedPolicy, apply_policy, format_plan_table
from compile_trainer.policy import CompilePolicy, policy_to_dict, to_policy
from compile_trainer.shapes import describe_shapes
from compile_trainer.warmup import ShapeHooks

log = logging.getLogger(__name__)


class CompileCallback(pl.Callback):
    """Compile a LightningModule's submodules by a declared policy, after it is on its device.

    Args:
        policy: a ``CompilePolicy``, a dict (or DictConfig) of its fields, or the name of a
            bundled policy (``none``, ``full``, ``regional``, ...). Validated here, so a bad
            policy fails when the callback is made.
        print_plan: print the plan table at fit start.
        **overrides: fields merged over ``policy``, e.g. ``backend="aot_eager"``.
    """

    def __init__(self, policy: Any = "regional", print_plan: bool = True, **overrides: Any):
        self.policy: CompilePolicy = to_policy(policy, **overrides)
        self.print_plan = print_plan
        self.applied: Optional[AppliedPolicy] = None
        self.shape_hooks: Optional[ShapeHooks] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.applied is not None and getattr(pl_module, APPLIED_ATTR, None) is self.applied:
            return  # a second fit() of the same model keeps the compiled regions
        self.applied = apply_policy(pl_module, self.policy, device=pl_module.device)
        if self.print_plan:
            rank_zero_info(format_plan_table(self.applied))
        for logger in trainer.loggers:
            logger.log_hyperparams({"compile_policy": policy_to_dict(self.policy), "compile_plan": self.applied.rows()})

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.policy.shapes.active:
            self.shape_hooks = ShapeHooks(trainer, self.policy.shapes)
            if self.print_plan:
                rank_zero_info(describe_shapes(self.policy.shapes))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_shape_hooks()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_shape_hooks()

    def _remove_shape_hooks(self) -> None:
        if self.shape_hooks is not None:
            self.shape_hooks.remove()
            self.shape_hooks = None
