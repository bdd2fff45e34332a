"""``CompileCallback``: applies a compile policy to a LightningModule inside a Lightning Trainer.

It only wires the library's parts to Lightning's hooks; everything it does can be called without
Lightning (``to_policy``, ``apply_policy``, ``format_plan_table``, ``BatchShaper``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from compile_trainer.cache.session import CompileCache
from compile_trainer.compiling.background import BackgroundCompile
from compile_trainer.compiling.cuda_graph_grads import GradientCopies, copy_cuda_graph_gradients
from compile_trainer.compiling.eager_reference import EagerReferenceSteps, eager_reference_for
from compile_trainer.compiling.plan_table import format_plan_table, plan_rows
from compile_trainer.compiling.regions import APPLIED_ATTR, AppliedPolicy, apply_policy
from compile_trainer.compiling.runtime_checks import check_distributed_runtime, check_policy_runtime
from compile_trainer.compiling.warmup import start_compiler_warmup
from compile_trainer.lightning.batch_hooks import ShapeHooks
from compile_trainer.lightning.fit_telemetry import FitTelemetry, cache_metrics, telemetry_for
from compile_trainer.lightning.no_telemetry import NoTelemetry
from compile_trainer.lightning.strategies import (
    BACKGROUND_IN_FOREGROUND_UNDER_FSDP2,
    BUCKET_WARMUP_OFF_UNDER_FSDP2,
    adopted_policy,
    compiles_in_background,
    link_plan,
    strategy_kind,
    warms_up_buckets,
    where_compiled,
)
from compile_trainer.optimizer import (
    CompiledOptimizerStep,
    OptimizerChoice,
    compile_optimizers,
    describe_steps,
    take_over_clipping,
)
from compile_trainer.schema import CompilePolicy, PolicyError, policy_to_dict, to_policy, to_telemetry_config
from compile_trainer.schema.shapes import describe_shapes
from compile_trainer.telemetry.communication import format_link_plan

log = logging.getLogger(__name__)
WARM_AFTER_STEPS = 2  # optimizer steps after which the compile cache writes its bundle (all of a step compiled)


class CompileCallback(pl.Callback):
    """Compile a LightningModule's submodules by a declared policy, after it is on its device.

    Args:
        policy: a ``CompilePolicy``, a dict (or DictConfig) of its fields, the name of a bundled
            policy (``none``, ``full``, ``regional``, ...) or a policy file's path (``configs/compile/
            mine.yaml``). Validated here, so a bad policy fails when the callback is made.
        print_plan: print the plan table at fit start.
        telemetry: compile and throughput telemetry: ``True`` (default), ``False``, or a
            ``TelemetryConfig`` / dict of its fields (see ``compile_trainer.schema.telemetry``).
        **overrides: fields merged over ``policy``, e.g. ``backend="aot_eager"``.
    """

    def __init__(self, policy: Any = "regional", print_plan: bool = True, telemetry: Any = True, **overrides: Any):
        self.policy: CompilePolicy = check_policy_runtime(to_policy(policy, **overrides))
        start_compiler_warmup(self.policy)  # overlaps the model's building and the Trainer's set-up
        self.print_plan = print_plan
        self.applied: Optional[AppliedPolicy] = None
        self.shape_hooks: Optional[ShapeHooks] = None
        self.background: Optional[BackgroundCompile] = None
        self.eager_reference: Optional[EagerReferenceSteps] = None  # the first steps, run eagerly for the speedup
        self._warm_at_step = WARM_AFTER_STEPS  # the compile cache's first save: after the eager reference steps
        self.optimizer_steps: List[CompiledOptimizerStep] = []
        self.gradient_copies: Optional[GradientCopies] = None
        self.trainer_clipping: Optional[tuple] = None  # the Trainer's clipping, handed to the compiled steps
        self.cache: Optional[CompileCache] = None
        self._loads_at_step_start = 0  # the precompiled layer's loads when the step started
        self.strategy = "single"  # single, ddp or fsdp2 (lightning.strategies), known at setup
        self.applied_before_fit: Optional[AppliedPolicy] = None  # on the module at setup, before configure_model
        self.ranks: Optional[Dict[str, Any]] = None  # the per-rank report at fit end, on a distributed run
        self.link = None  # the link probed and the step's communication on it, at fit start on several ranks
        self.telemetry: Union[FitTelemetry, NoTelemetry] = telemetry_for(to_telemetry_config(telemetry))

    def summary(self) -> Dict[str, Any]:
        """Headline numbers of the telemetry (compile time, recompiles, steady throughput, MFU...)."""
        summary = self.telemetry.summary()
        summary |= self.background.summary() if self.background is not None else {}
        summary |= {"ranks": self.ranks} if self.ranks is not None else {}
        summary |= {"link": self.link.as_dict()} if self.link is not None else {}
        return summary | (self.cache.summary(summary.get("compile_time_s")) if self.cache is not None else {})

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.optimizer_steps = compile_optimizers(
            trainer.optimizers, self.policy.optimizer, self.policy.backend, lambda c: _log_choice(trainer, c)
        )
        self._clip_in_optimizer_steps(trainer, pl_module)
        if self.print_plan and self.optimizer_steps:
            rank_zero_info(describe_steps(self.optimizer_steps))
        if self.applied is not None and getattr(pl_module, APPLIED_ATTR, None) is self.applied:
            self.telemetry.start(trainer, pl_module, self.applied)  # a second fit() keeps the compiled regions
            self._copy_gradients_if_they_outlive_a_step(trainer, pl_module)
            return
        if self.telemetry.enabled and self.telemetry.config.link_probe:  # before any compile thread starts
            self.link = link_plan(trainer, pl_module, self.strategy)
        self.telemetry.before_policy(pl_module)
        if self.policy.cache.active and self.policy.enabled:  # the bundle is loaded before anything compiles
            self.cache = CompileCache(self.policy.cache)
            self.cache.load(pl_module, self.policy, pl_module.device)
            self.telemetry.recorded_flops = self.cache.outcome.flops_record
        self.applied = adopted_policy(pl_module, self.policy, self.strategy, self.applied_before_fit)
        if self.applied is None:
            self.applied = apply_policy(pl_module, self.policy, device=pl_module.device)
            self.applied.applied_by = "CompileCallback"
        if self.cache is not None:
            self.cache.attach(self.applied)
        if self.applied.defers_compiles:
            if compiles_in_background(self.strategy):
                self.background = BackgroundCompile(self.applied)
            else:
                self.applied.compile_in_foreground(BACKGROUND_IN_FOREGROUND_UNDER_FSDP2)
        reference_steps = self.telemetry.config.eager_reference_steps if self.telemetry.enabled else 0
        fit_steps = trainer.max_steps - trainer.global_step if trainer.max_steps > 0 else None  # resumed: those left
        self.eager_reference = eager_reference_for(self.applied, reference_steps, fit_steps)
        self.telemetry.start(trainer, pl_module, self.applied)
        if self.print_plan:
            cache_line = [self.cache.describe()] if self.cache is not None else []
            where = [where_compiled(self.strategy)] if self.strategy != "single" else []
            where += [format_link_plan(self.link)] if self.link is not None else []
            eager = [self.eager_reference.describe()] if self.eager_reference is not None else []
            rank_zero_info("\n".join([format_plan_table(self.applied), *where, *cache_line, *eager]))
        chosen = self.shape_hooks.choose_auto_buckets() if self.shape_hooks is not None else None
        if chosen and self.print_plan:
            rank_zero_info(chosen)
        self._copy_gradients_if_they_outlive_a_step(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_hyperparams(
                {"compile_policy": policy_to_dict(self.policy), "compile_plan": plan_rows(self.applied)}
            )

    def _clip_in_optimizer_steps(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The Trainer's ``gradient_clip_val`` clips inside the compiled steps, and Lightning's clipping is off
        until teardown (a module's own ``configure_gradient_clipping`` keeps Lightning's)."""
        if not self.optimizer_steps or not trainer.gradient_clip_val:
            return
        if is_overridden("configure_gradient_clipping", pl_module):
            rank_zero_info("note: configure_gradient_clipping is overridden: Lightning clips, not the optimizer step")
            return
        algorithm = trainer.gradient_clip_algorithm
        take_over_clipping(self.optimizer_steps, trainer.gradient_clip_val, algorithm.value if algorithm else "norm")
        self.trainer_clipping = (trainer.gradient_clip_val, algorithm)
        trainer.gradient_clip_val = None

    def _copy_gradients_if_they_outlive_a_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under CUDA graphs, gradients that must survive the next step's replays get their own memory."""
        outlive = trainer.accumulate_grad_batches > 1 or not pl_module.automatic_optimization
        if self.applied.uses_cuda_graphs and outlive and self.gradient_copies is None:
            self.gradient_copies = copy_cuda_graph_gradients(self.applied)
            if self.print_plan:
                rank_zero_info(f"note: {self.gradient_copies.describe()}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        others = [c for c in trainer.callbacks if isinstance(c, CompileCallback) and c is not self]
        if others:
            names = ", ".join(repr(c.policy.name) for c in [self, *others])
            raise PolicyError(
                f"this Trainer has {len(others) + 1} CompileCallbacks (policies {names}); a model takes one compile "
                "policy: keep one CompileCallback and put every rule in its policy"
            )
        self.strategy = strategy_kind(trainer.strategy)  # an unsupported strategy fails here, before training
        # configure_model runs after setup: a policy on the module now was applied before this fit began
        self.applied_before_fit = getattr(pl_module, APPLIED_ATTR, None)
        if self.strategy != "single":
            check_distributed_runtime(self.policy)
        if stage == "fit" and self.policy.shapes.active:
            warm_up = warms_up_buckets(self.strategy)
            self.shape_hooks = ShapeHooks(
                trainer, self.policy.shapes, phase=self.telemetry.phase, warm_up_buckets=warm_up
            )
            if self.policy.shapes.pad.enabled:
                self.telemetry.add_summary_source("padding", self.shape_hooks.shaper.padding_summary)
            if self.print_plan:
                off = [BUCKET_WARMUP_OFF_UNDER_FSDP2] if self.policy.shapes.warmup and not warm_up else []
                rank_zero_info("\n".join([describe_shapes(self.policy.shapes), *off]))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_shape_hooks()
        self.telemetry.stop()

    def _remove_shape_hooks(self) -> None:
        if self.shape_hooks is not None:
            self.shape_hooks.remove()
            self.shape_hooks = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.background is not None and not self.background.installed and self.background.poll():
            _log_background(trainer, self.background)
        if self.eager_reference is not None:
            self.eager_reference.begin_step()
        self.applied.begin_step()
        self._loads_at_step_start = self.cache.precompiled_loads if self.cache is not None else 0
        self.telemetry.on_train_batch_start(trainer, batch)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.telemetry.on_before_optimizer_step(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        compiling = self.background is not None and self.background.disturbs_steps
        loaded = self.cache is not None and self.cache.precompiled_loads != self._loads_at_step_start
        eager = self.eager_reference is not None and self.eager_reference.in_step
        self.telemetry.on_train_batch_end(trainer, batch, compiling, loaded_compiled_code=loaded, eager_reference=eager)
        if eager:
            self.eager_reference.end_step()
            self._warm_at_step = trainer.global_step + WARM_AFTER_STEPS
        if trainer.global_step == self._warm_at_step:  # forward, backward and the optimizer's update compiled
            self._save_cache()

    def _save_cache(self, final: bool = False) -> None:
        """Write the bundle when warm (after the first steps, each validation, the fit: ``final``, with the
        precompiled regions); the cache decides whether anything new was compiled since its last save."""
        if self.cache is not None and self.applied is not None:
            if final and self.cache.pending_captures:  # a pause worth a word: each is traced and lowered again
                rank_zero_info(
                    f"compile cache: precompiling {self.cache.pending_captures} region call(s) for the bundle "
                    "(once per bundle: later runs skip their tracing)"
                )
            regions = [item.region.name for item in self.applied.compiled]
            flops = self.telemetry.flops_record()
            self.cache.save(regions, self.summary().get("compile_time_s"), final=final, flops_record=flops)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.telemetry.set_phase("sanity check" if trainer.sanity_checking else "validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._save_cache()

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.applied is not None:  # None in trainer.validate() without a fit: nothing was compiled
            self.applied.begin_step()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.background is not None and not self.background.installed:
            self.background.close(finish=False)  # training ended first: the thread stops after its current region
            _log_background(trainer, self.background)
        # Here, not at fit end: Lightning's teardown, before on_fit_end, moves a GPU module to the CPU, away from
        # the inputs its captures kept. The captures' traces are not the run's compiles.
        with self.telemetry.compiles_paused():
            self._save_cache(final=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.strategy != "single" and self.policy.distributed.report_divergent_recompiles:
            self.ranks = self.telemetry.report_ranks(trainer)  # a collective: every rank runs it
        cache = self.cache.summary(self.summary().get("compile_time_s")) if self.cache is not None else {}
        self.telemetry.finish(trainer, cache)
        if cache:
            rank_zero_info(self.cache.describe())
            for logger in trainer.loggers:
                logger.log_metrics(cache_metrics(cache), step=trainer.global_step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.telemetry.stop()
        self._remove_shape_hooks()
        if self.gradient_copies is not None:
            self.gradient_copies.remove()
            self.gradient_copies = None
        if self.trainer_clipping is not None:
            trainer.gradient_clip_val, trainer.gradient_clip_algorithm = self.trainer_clipping
            self.trainer_clipping = None


def _log_background(trainer: pl.Trainer, background: BackgroundCompile) -> None:
    rank_zero_info(background.describe())
    summary = background.summary().items()
    metrics = {f"compile/{k}": v for k, v in summary if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _log_choice(trainer: pl.Trainer, choice: OptimizerChoice) -> None:
    rank_zero_info(f"optimizer: {choice.describe()}")
    for logger in trainer.loggers:
        logger.log_hyperparams({"optimizer_choice": dataclasses.asdict(choice)})
