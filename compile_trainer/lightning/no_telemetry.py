"""``NoTelemetry``: ``FitTelemetry``'s methods doing nothing, what ``CompileCallback`` calls when telemetry is off.

Nothing is registered with torch, measured or logged; the queries answer as a fit without telemetry would
(``summary()`` empty, no FLOPs record, no events), so the callback calls its telemetry without asking whether
there is any.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional

import lightning.pytorch as pl

from compile_trainer.compiling.regions import AppliedPolicy
from compile_trainer.schema import TelemetryConfig
from compile_trainer.telemetry.compile_events import CompileTelemetry
from compile_trainer.telemetry.throughput import ThroughputMeter


class NoTelemetry:
    """Telemetry off: ``FitTelemetry``'s interface (tests/test_fit_telemetry.py holds them to the same one)."""

    enabled = False
    compile: Optional[CompileTelemetry] = None
    throughput: Optional[ThroughputMeter] = None
    recorded_flops: Optional[Dict[str, Any]] = None  # the compile cache's count, unused
    flops_source: Optional[str] = None

    def __init__(self, config: TelemetryConfig):
        self.config = config

    # -- hooks: nothing to do ------------------------------------------------------------------------

    def add_summary_source(self, part: str, source: Callable[[], Dict[str, Any]]) -> None: ...
    def before_policy(self, pl_module: pl.LightningModule) -> None: ...
    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, applied: Optional[AppliedPolicy]) -> None: ...
    def set_phase(self, phase: str) -> None: ...
    def on_train_batch_start(self, trainer: pl.Trainer, batch: Any) -> None: ...
    def on_before_optimizer_step(self, trainer: pl.Trainer) -> None: ...
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        batch: Any,
        compiling: bool = False,
        loaded_compiled_code: bool = False,
        eager_reference: bool = False,
    ) -> None: ...
    def finish(self, trainer: pl.Trainer, extra: Optional[Dict[str, Any]] = None) -> None: ...
    def log_metrics(self, trainer: pl.Trainer) -> None: ...
    def stop(self) -> None: ...

    # -- contexts and queries: what a fit without telemetry has ---------------------------------------

    def phase(self, name: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def compiles_paused(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def report_ranks(self, trainer: pl.Trainer) -> Optional[Dict[str, Any]]:
        return None

    def flops_record(self) -> Optional[Dict[str, Any]]:
        return None

    def metrics(self) -> Dict[str, float]:
        return {}

    def summary(self) -> Dict[str, Any]:
        return {}

    def events(self) -> List[List[Any]]:
        return []

    def format_summary(self, summary: Dict[str, Any]) -> str:
        return ""
