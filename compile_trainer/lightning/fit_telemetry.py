"""Telemetry of a Lightning fit: compile events and throughput, logged through the Trainer's loggers.

``FitTelemetry`` holds the logic that ``CompileCallback`` calls from its hooks (``telemetry_for`` gives it, or
``no_telemetry.NoTelemetry``, which does nothing, when telemetry is off). Series go to every
logger under ``compile/...`` and ``throughput/...`` (so CSV and TensorBoard get them too); a W&B run
also gets a table of recompile / graph-break events, a table of regions, and the headline numbers in
its summary under ``summary/<key>``. ``summary()`` returns those numbers as a plain dict; its keys are
documented in ``docs/telemetry.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from compile_trainer import compat
from compile_trainer.compiling.regions import AppliedPolicy
from compile_trainer.lightning.no_telemetry import NoTelemetry
from compile_trainer.schema import SettingsError, TelemetryConfig
from compile_trainer.tables import plural
from compile_trainer.telemetry.compile_events import EVENT_COLUMNS, CompileTelemetry
from compile_trainer.telemetry.compile_report import format_compile_report
from compile_trainer.telemetry.flops import StepFlopCount, step_signature
from compile_trainer.telemetry.ranks import describe_rank_report, gather_rank_summaries, rank_metrics, rank_report
from compile_trainer.telemetry.throughput import (
    COMPILE,
    EAGER,
    STEADY,
    WARMUP,
    ThroughputMeter,
    device_peak_flops,
    precision_dtype,
)
from compile_trainer.telemetry.throughput_report import format_throughput, slower_than_eager

log = logging.getLogger(__name__)


def resolve_callable(value: Any, what: str) -> Optional[Callable[[Any], int]]:
    """A function, or one named by ``"package.module:function"`` (or ``"package.module.function"``)."""
    if value is None or callable(value):
        return value
    path = str(value)
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise SettingsError(
            f"telemetry.{what}={path!r} cannot be imported ({error}); give 'package.module:function'."
        ) from error
    if not callable(found):
        raise SettingsError(f"telemetry.{what}={path!r} is a {type(found).__name__}, not a function.")
    return found


def metric_key(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", label)


class FitTelemetry:
    """Compile telemetry and throughput for one LightningModule across its fits."""

    enabled = True

    def __init__(self, config: TelemetryConfig):
        self.config = config
        self.items_fn = resolve_callable(config.items_fn, "items_fn")
        self.samples_fn = resolve_callable(config.samples_fn, "samples_fn")
        self.tokens_fn = resolve_callable(config.tokens_fn, "tokens_fn")
        self.compile: Optional[CompileTelemetry] = None
        self.throughput: Optional[ThroughputMeter] = None
        self._flops: Optional[float] = config.flops_per_step
        self._count_flops = False  # at the next training batch
        self._flop_count: Optional[StepFlopCount] = None  # counting the FLOPs of the step under way
        self._counted_step = False  # the step under way is (was) the one counted: not a steady step
        # A count made elsewhere for a step signature (the compile cache's bundle: its cold run's count), used
        # instead of counting when the first step's signature is the same; and this run's count with its signature.
        self.recorded_flops: Optional[Dict[str, Any]] = None
        self._flops_signature: Optional[str] = None
        self.flops_source: Optional[str] = "configured" if config.flops_per_step else None
        self._steps = 0
        self._logged_steps = 0
        self._compiles_at_start = 0
        self._recordings_at_start = self._warmed_up_at_start = 0
        # Other parts' headline numbers by part (``"padding"``), merged into ``summary()``
        self.summary_sources: Dict[str, Callable[[], Dict[str, Any]]] = {}

    def add_summary_source(self, part: str, source: Callable[[], Dict[str, Any]]) -> None:
        """``source()``'s numbers go into ``summary()`` (replacing an earlier source of ``part``)."""
        self.summary_sources[part] = source

    # -- hooks --------------------------------------------------------------------------------------

    def before_policy(self, pl_module: pl.LightningModule) -> None:
        """The model's first fit (its policy is about to be applied): count the FLOPs of its first training step,
        unless ``flops_per_step`` is given or ``measure_flops`` is off. A later fit of the same model keeps them."""
        if self._flops is None and self.config.measure_flops:
            problem = compat.flop_counting_problem()
            if problem is None:
                self._count_flops = True
            else:
                log.warning("FLOPs per step not measured: %s; set telemetry.flops_per_step to get MFU", problem)

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, applied: Optional[AppliedPolicy]) -> None:
        if self.compile is None:
            self.compile = CompileTelemetry(applied, pl_module)
        self.compile.install()
        self.compile.phase = "fit start"
        device = pl_module.device
        peak = device_peak_flops(device, precision_dtype(trainer.precision), self.config.peak_tflops)
        if peak is None and device.type == "cuda":
            log.info("peak FLOP/s of %s unknown: set telemetry.peak_tflops to get MFU", torch.cuda.get_device_name())
        if self.throughput is None:
            self.throughput = ThroughputMeter(
                device, self.samples_fn, self.items_fn, self.config.items_per_sample, self._flops, peak, self.tokens_fn,
                self.config.items_unit,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def set_phase(self, phase: str) -> None:
        if self.compile is not None:
            self.compile.phase = phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Compiles inside are attributed to phase ``name``; the previous phase is restored after."""
        previous = self.compile.phase if self.compile is not None else None
        self.set_phase(name)
        try:
            yield
        finally:
            if previous is not None:
                self.set_phase(previous)

    def compiles_paused(self) -> ContextManager[None]:
        """Compiles inside are not the run's (``CompileTelemetry.paused``): the compile cache's captures."""
        return self.compile.paused() if self.compile is not None else contextlib.nullcontext()

    def on_train_batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        self.compile.ensure_installed()
        self.compile.phase, self.compile.step = "train", trainer.global_step
        self._compiles_at_start = self.compile.compile_count
        self._recordings_at_start = self.compile.cudagraph_recordings
        self._warmed_up_at_start = compat.cudagraph_warmed_up_functions()
        self.throughput.step_start(batch)
        if self._flop_count is not None:  # the last batch never ended (on_train_batch_start returned -1): again
            self._flop_count.abort()
            self._flop_count, self._count_flops = None, True
        if self._count_flops:
            self._flops_signature = step_signature(batch, trainer.lightning_module.training_step)
            if self.recorded_flops and self.recorded_flops.get("signature") == self._flops_signature:
                self._count_flops = False  # the same step counted before: no dispatch mode on this step
                self._flops, self.flops_source = float(self.recorded_flops["flops"]), "compile cache"
                self.throughput.flops_per_step = self._flops
        self._counted_step = self._count_flops
        if self._count_flops:
            self._count_flops = False
            self._flop_count = StepFlopCount()
            self._flop_count.start()

    def on_before_optimizer_step(self, trainer: pl.Trainer) -> None:
        """Automatic optimization: the step's forward and backward are done; the optimizer's update is not counted.
        (Manual optimization steps optimizers inside ``training_step``: its count goes on to the batch's end.)"""
        if self._flop_count is not None and trainer.lightning_module.automatic_optimization:
            self._finish_flop_count()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        batch: Any,
        compiling: bool = False,
        loaded_compiled_code: bool = False,
        eager_reference: bool = False,
    ) -> None:
        """``compiling``: a compile was under way during the step elsewhere (a background compile), so the
        step does not count as steady state either; ``loaded_compiled_code``: the step loaded precompiled code
        from the compile cache (a warm-up step: nothing compiled, but it paused); ``eager_reference``: the step ran
        the compiled regions' original code (``compiling.eager_reference``; no background thread runs beside it)."""
        if self._flop_count is not None:
            self._finish_flop_count()
        compiled = self.compile.compile_count != self._compiles_at_start
        recorded = self.compile.cudagraph_recordings != self._recordings_at_start
        warmed_up = compat.cudagraph_warmed_up_functions() != self._warmed_up_at_start
        paused = self._counted_step or loaded_compiled_code or warmed_up
        if eager_reference:
            kind = COMPILE if compiled else EAGER
        else:
            kind = COMPILE if compiled or compiling else WARMUP if paused else STEADY
        self.throughput.step_end(kind, recorded, warmed_up, eager_reference=eager_reference)
        if compiled:
            self.compile.collect()
        self._steps += 1
        every = self.config.log_every_n_steps or trainer.log_every_n_steps or 50
        if self._steps % every == 0:
            self.log_metrics(trainer)

    def finish(self, trainer: pl.Trainer, extra: Optional[Dict[str, Any]] = None) -> None:
        """End of fit: the last series, W&B tables and summary, and the summary table on the console.
        ``extra``: more headline numbers for the W&B summary (the compile cache's)."""
        self.log_metrics(trainer)
        summary = {**self.summary(), **(extra or {})}
        for logger in trainer.loggers:
            if _is_wandb(logger) and trainer.is_global_zero:  # another rank's W&B run is a stand-in with no summary
                self._log_wandb(logger, summary)
        if self.config.print_summary:
            rank_zero_info(self.format_summary(summary))
        slower = slower_than_eager(summary, self.throughput.device.type, self.compile.applied)
        if slower is not None and trainer.is_global_zero:
            log.warning(slower)

    def stop(self) -> None:
        if self._flop_count is not None:  # the step failed before its end
            self._flop_count.abort()
            self._flop_count = None
        if self.compile is not None:
            self.compile.uninstall()

    def report_ranks(self, trainer: pl.Trainer) -> Optional[Dict[str, Any]]:
        """Every rank's compile time and recompiles, gathered (a collective: every rank calls it), printed and
        logged once; the report, or None on one process."""
        summaries = gather_rank_summaries(self.summary())
        if summaries is None:
            return None
        report = rank_report(summaries)
        rank_zero_info(describe_rank_report(report))
        for logger in trainer.loggers:  # Lightning's loggers write on rank 0 only
            logger.log_metrics(rank_metrics(report), step=trainer.global_step)
        return report

    # -- measurements -------------------------------------------------------------------------------

    def _finish_flop_count(self) -> None:
        """The FLOPs of the step just run (``telemetry.flops.StepFlopCount``), for TFLOP/s and MFU."""
        count, self._flop_count = self._flop_count, None
        try:
            self._flops = float(count.finish()) or None
            self.flops_source = "counted" if self._flops else None
        except Exception as error:  # a compiled graph that cannot run on fake tensors, ...
            log.warning(
                "FLOPs per step not measured (%s); set telemetry.flops_per_step to get TFLOP/s and MFU",
                compat.traced_error_summary(error),
            )
        self.throughput.flops_per_step = self._flops

    def flops_record(self) -> Optional[Dict[str, Any]]:
        """This run's FLOPs per step with the signature of the step they were counted on (for the compile cache)."""
        if self._flops is None or self._flops_signature is None:
            return None
        return {"signature": self._flops_signature, "flops": self._flops}

    def metrics(self) -> Dict[str, float]:
        """Series for the loggers: compile counts so far and throughput since the last call."""
        self.compile.collect()
        values: Dict[str, float] = {}
        for key, value in self.compile.totals().items():
            values[f"compile/{key}"] = value
        for stats in self.compile.regions.values():
            prefix = f"compile/{metric_key(stats.label)}"
            values[f"{prefix}/compiles"] = stats.compiles
            values[f"{prefix}/recompiles"] = stats.recompiles
            values[f"{prefix}/grad_mode_variants"] = stats.grad_mode_variants
            values[f"{prefix}/graphs"] = stats.graphs
            values[f"{prefix}/compile_time_s"] = stats.compile_time_s
            values[f"{prefix}/cache_hits"] = stats.cache_hits
            values[f"{prefix}/cache_misses"] = stats.cache_misses
        values["throughput/compile_steps"] = self.throughput.compiling.steps
        for key, value in self.throughput.interval().items():
            values[f"throughput/{key}"] = value
        return values

    def log_metrics(self, trainer: pl.Trainer) -> None:
        if not trainer.loggers or self._logged_steps == self._steps:
            return
        self._logged_steps = self._steps
        values = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def summary(self) -> Dict[str, Any]:
        """The headline numbers of the run so far, as a plain dict with stable keys (docs/telemetry.md)."""
        if self.compile is None:
            return {}
        self.compile.collect()
        summary = {**self.compile.totals(), **self.throughput.summary(wait=True)}
        summary["flops_source"] = self.flops_source
        for source in self.summary_sources.values():
            summary.update(source())
        return summary

    def events(self) -> List[List[Any]]:
        return [event.row() for event in self.compile.events] if self.compile is not None else []

    def _log_wandb(self, logger: Any, summary: Dict[str, Any]) -> None:
        import wandb

        run = logger.experiment
        regions = self.compile.region_rows()
        region_columns = [
            "label",
            "modules",
            "compiles",
            "recompiles",
            "grad_mode_variants",
            "graphs",
            "compile_time_s",
            "graph_breaks",
            "cache_hits",
            "cache_misses",
        ]
        run.log(
            {
                "compile/events": wandb.Table(columns=list(EVENT_COLUMNS), data=self.events()),
                "compile/regions": wandb.Table(
                    columns=region_columns,
                    data=[
                        [", ".join(r["modules"]) if c == "modules" else r[c] for c in region_columns] for r in regions
                    ],
                ),
            }
        )
        run.summary.update({f"summary/{key}": value for key, value in summary.items() if value is not None})

    def format_summary(self, summary: Dict[str, Any]) -> str:
        lines = [format_compile_report(self.compile), *format_throughput(summary)]
        lines.append(
            f"  compile time {summary['compile_time_s']:,.2f} s, {plural(summary['recompiles'], 'recompile')} "
            f"(and {plural(summary['grad_mode_variants'], 'grad-mode variant')}, expected), "
            f"{plural(summary['graph_breaks'], 'graph break')}, {plural(summary['unique_graphs'], 'graph')}"
        )
        if summary.get("padding_overhead") is not None:
            expected = summary.get("expected_padding_overhead")
            buckets = f" to buckets {summary['buckets']}" if summary["buckets"] else ""
            lines.append(
                f"  padding{buckets}: {summary['padding_overhead']:.1%} more positions than the data"
                + (f" (expected {expected:.1%})" if expected is not None else "")
            )
        if summary["cudagraph_skips"]:
            skipped = plural(summary["cudagraph_skips"], "graph")
            lines.append(f"  {skipped} run without the CUDA graphs asked for (see above)")
        return "\n".join(lines)


def telemetry_for(config: TelemetryConfig) -> Union[FitTelemetry, NoTelemetry]:
    """The fit's telemetry: ``FitTelemetry``, or ``NoTelemetry`` when ``config.enabled`` is off."""
    return FitTelemetry(config) if config.enabled else NoTelemetry(config)


def cache_metrics(cache_summary: Dict[str, Any]) -> Dict[str, float]:
    """The compile cache's numbers as logger series (``cache/<key>``); ``cache/hit`` is 1 for a hit, else 0."""
    values = {f"cache/{key[len('cache_') :]}": value for key, value in cache_summary.items()}
    numbers = {key: float(value) for key, value in values.items() if isinstance(value, (int, float))}
    return numbers | {"cache/hit": float(cache_summary.get("cache_status") == "hit")}


def _is_wandb(logger: Any) -> bool:
    from lightning.pytorch.loggers import WandbLogger

    return isinstance(logger, WandbLogger)
