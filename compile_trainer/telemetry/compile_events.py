"""Compile telemetry: what Dynamo compiled, recompiled and broke, attributed to the policy's regions.

Everything is read in-process from PyTorch's structured sources, never from stderr:

- the compile start/end callbacks (``torch._dynamo.callback.callback_handler``): each compile's id
  (``"frame/attempt"``; attempt > 0 is a recompile), its trigger (a frame, a lazy backward, CUDA-graph
  recording) and its wall time. ``torch._dynamo.reset()`` clears them, so ``ensure_installed()`` re-registers;
- ``torch._dynamo.utils.graph_break_reasons``: one ``GraphCompileReason`` per graph break, with the reason
  and the user stack (the list ``torch._dynamo.explain`` reads);
- ``torch._dynamo.utils.counters``: process-wide, so diffed around each compile (unique graphs);
- ``get_compilation_metrics()``: the compiled frame's code name and file, the guard that failed for a
  recompile, frames that fell back to eager (the recompile limit, breaks Dynamo cannot resume from).

Which region a compile belongs to: ``telemetry.region_attribution``. The data it returns:
``telemetry.compile_records``; as text: ``telemetry.compile_report``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling.regions import ENTRY_PREFIX, AppliedPolicy
from compile_trainer.telemetry.compile_event_log import CompileEventLog
from compile_trainer.telemetry.compile_records import (
    EVENT_COLUMNS,
    OUTSIDE_REGIONS,
    WARMUP_PHASE,
    CompileEvent,
    CompileRecord,
    GraphBreak,
    RegionStats,
    Where,
    first_line,
    guard_text,
    split_compile_id,
)
from compile_trainer.telemetry.compile_report import format_compile_report
from compile_trainer.telemetry.fixes import recompile_fix
from compile_trainer.telemetry.region_attribution import (
    declared_functions,
    entry_on_stack,
    owning_modules,
    region_labels,
)

# The engine, and what callers import with it from here (defined in compile_records and region_attribution).
__all__ = [
    "EVENT_COLUMNS",
    "OUTSIDE_REGIONS",
    "WARMUP_PHASE",
    "CUDAGRAPH_RECORDING",
    "CompileEvent",
    "CompileTelemetry",
    "GraphBreak",
    "RegionStats",
    "first_line",
    "guard_text",
    "region_labels",
    "split_compile_id",
]

log = logging.getLogger(__name__)

CUDAGRAPH_RECORDING = "CUDAGRAPH_RECORDING"  # the compile callbacks' trigger while Inductor records CUDA graphs


def _cache_lookups() -> Tuple[int, int]:
    """(hits, misses) of torch's compile caches so far, all layers together."""
    counts = compat.cache_counters().values()
    return sum(hits for hits, _ in counts), sum(misses for _, misses in counts)


class CompileTelemetry:
    """Collects compile events while installed; ``collect()`` turns what Dynamo recorded into stats.

    Cheap in steady state: nothing runs unless Dynamo compiles. ``step`` and ``phase`` are set by the
    caller (the Lightning callback) so that events say when they happened.
    """

    def __init__(self, applied: Optional[AppliedPolicy] = None, root: Optional[nn.Module] = None):
        self.applied = applied
        self.root = root if root is not None else (applied.root if applied is not None else None)
        self.step: Optional[int] = None
        self.phase = "setup"
        self.compile_count = 0  # compiles started, any trigger: a step during which it changes is a compile step
        self.cudagraph_recordings = 0  # of which CUDA-graph recordings (Inductor's CUDAGRAPH_RECORDING trigger)
        self.compile_time_s = 0.0
        self.unique_graphs = 0
        self.event_log = CompileEventLog(declared_functions(applied, self.root))
        self.events: List[CompileEvent] = self.event_log.events
        self.breaks: Dict[Tuple[str, str, str], GraphBreak] = self.event_log.breaks
        self.regions: Dict[str, RegionStats] = {}
        self.runtime_cudagraph_skips = 0  # skipped when a graph ran, not when it compiled: region unknown
        self._cudagraph_skips_seen = compat.cudagraph_skips()  # Inductor's counter, as far as the events account for it
        self._labels = region_labels(applied)
        for label, names in self._labels.values():
            self.regions[label] = RegionStats(label, names)
        self._installed = False
        self._active: Optional[CompileRecord] = None
        self._forward: Dict[str, CompileRecord] = {}  # compile id -> its frame compile, until its metrics arrive
        self._finished: Dict[str, CompileRecord] = {}  # compile id -> frame compile, for lazy backward attribution
        self._backward: List[CompileRecord] = []
        self._frame_entry: Dict[str, str] = {}  # frame number -> entry name
        # a compiled function, (frame number, functions its closure holds) -> grad modes it has a graph for
        self._grad_modes: Dict[Tuple[str, Tuple[int, ...]], set] = {}
        self._requires_grad_variants: set = set()  # (compiled function, grad mode) with a requires-grad variant
        self._last_metric: Any = None

    # -- installation -------------------------------------------------------------------------------

    def install(self) -> CompileTelemetry:
        metrics = compat.compilation_metrics()
        self._last_metric = metrics[-1] if metrics else None  # earlier compiles are not ours
        self._cudagraph_skips_seen = compat.cudagraph_skips()
        self.ensure_installed()
        return self

    def ensure_installed(self) -> None:
        """Register the callbacks (again, after a ``torch._dynamo.reset()`` cleared them)."""
        handler = compat.dynamo_callback_handler()
        if self._on_start in handler.start_callbacks:
            return
        if self._installed:  # a reset happened: compile ids restart at 0/0
            self._frame_entry.clear()
            self._grad_modes.clear()
            self._requires_grad_variants.clear()
            self._forward.clear()
            self._finished.clear()
        handler.register_start_callback(self._on_start)
        handler.register_end_callback(self._on_end)
        self._installed = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Compiles inside are not the run's (the compile cache's captures trace each region again after
        training): neither counted nor reported, their metrics and counters skipped."""
        self.collect()
        installed = self._installed
        self.uninstall()
        try:
            yield
        finally:
            metrics = compat.compilation_metrics()
            self._last_metric = metrics[-1] if metrics else self._last_metric
            self._cudagraph_skips_seen = compat.cudagraph_skips()
            if installed:
                self.ensure_installed()

    def uninstall(self) -> None:
        handler = compat.dynamo_callback_handler()
        if self._on_start in handler.start_callbacks:
            handler.remove_start_callback(self._on_start)
        if self._on_end in handler.end_callbacks:
            handler.remove_end_callback(self._on_end)
        self._installed = False

    # -- callbacks (run inside Dynamo; keep them small) ---------------------------------------------

    def _on_start(self, args: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        compile_id = str(getattr(args, "compile_id", ""))
        self._read_metrics()
        entry = entry_on_stack() if trigger == "DYNAMO" else None
        self._active = CompileRecord(
            compile_id=compile_id,
            trigger=trigger,
            entry=entry,
            phase=self.phase,
            step=self.step,
            started=time.perf_counter(),
            grad_enabled=torch.is_grad_enabled(),
            breaks_before=len(compat.graph_break_reasons()),
            graphs_before=compat.unique_graphs(),
            cudagraph_skips_before=compat.cudagraph_skips(),
            cache_before=_cache_lookups(),
            functions=compat.functions_closed_over() if trigger == "DYNAMO" else (),
        )
        self.compile_count += 1
        self.cudagraph_recordings += trigger == CUDAGRAPH_RECORDING

    def _on_end(self, args: Any) -> None:
        record, self._active = self._active, None
        if record is None:
            return
        record.seconds = time.perf_counter() - record.started
        record.graphs = compat.unique_graphs() - record.graphs_before
        record.cudagraph_skips = compat.cudagraph_skips() - record.cudagraph_skips_before
        hits, misses = _cache_lookups()
        record.cache_hits, record.cache_misses = hits - record.cache_before[0], misses - record.cache_before[1]
        reasons = compat.graph_break_reasons()
        record.breaks = list(reasons[record.breaks_before :]) if len(reasons) >= record.breaks_before else []
        self.compile_time_s += record.seconds
        if record.trigger == "DYNAMO":
            self._forward[record.compile_id] = record
        else:
            self._backward.append(record)

    # -- turning records into stats -----------------------------------------------------------------

    def collect(self) -> List[CompileEvent]:
        """Process everything recorded since the last call; return the new events."""
        before = len(self.events)
        self._read_metrics()
        for compile_id in list(self._forward):  # ended, but its metrics fell out of Dynamo's bounded deque
            self._finish(self._forward.pop(compile_id), None)
        for record in self._backward:
            self._finish(record, None)
        self._backward.clear()
        self._runtime_cudagraph_skips()
        self._count_graph_breaks()
        return self.events[before:]

    def _count_graph_breaks(self) -> None:
        """Each region's graph breaks, as ``graph_breaks()`` lists them (one without a location counted once with the
        same break that has one), the declared ones apart: the report's rows and list and ``totals()`` count these."""
        for stats in self.regions.values():
            stats.graph_breaks = stats.declared_graph_breaks = 0
        for item in self.graph_breaks():
            stats = self._stats(item.region)
            if item.declared:
                stats.declared_graph_breaks += 1
            else:
                stats.graph_breaks += 1

    def _read_metrics(self) -> None:
        metrics = compat.compilation_metrics()
        start = 0
        if self._last_metric is not None:
            for index in range(len(metrics) - 1, -1, -1):
                if metrics[index] is self._last_metric:
                    start = index + 1
                    break
        for metric in metrics[start:]:
            self._on_metric(metric)
        if metrics:
            self._last_metric = metrics[-1]

    def _on_metric(self, metric: Any) -> None:
        if getattr(metric, "is_forward", True) is False:
            return  # a backward compile: timed by its LAZY_BACKWARD callbacks
        compile_id = str(getattr(metric, "compile_id", "") or "")
        record = self._forward.pop(compile_id, None)
        if record is not None:
            self._finish(record, metric)
        elif getattr(metric, "fail_type", None):  # refused before any callback ran: the recompile limit
            frame, attempt = split_compile_id(compile_id)
            entry = self._frame_entry.get(frame)
            self._failure(entry, compile_id, attempt, metric, self.phase, self.step)

    def _label(self, entry: Optional[str]) -> str:
        if entry is not None and entry not in self._labels:  # made after the plan: a block's own (block_values)
            self._labels = region_labels(self.applied)
        if entry is not None and entry in self._labels:
            return self._labels[entry][0]
        if entry is not None:
            return entry[len(ENTRY_PREFIX) :]
        return OUTSIDE_REGIONS

    def _stats(self, label: str) -> RegionStats:
        if label not in self.regions:
            self.regions[label] = RegionStats(label)
        return self.regions[label]

    def _finish(self, record: CompileRecord, metric: Any) -> None:
        frame, attempt = split_compile_id(record.compile_id)
        co_name = getattr(metric, "co_name", None) or ""
        entry = co_name if co_name.startswith(ENTRY_PREFIX) else record.entry
        if entry is None and record.trigger != "DYNAMO":
            forward = self._finished.get(record.compile_id)
            entry = forward.entry if forward is not None else None
        if record.trigger == "DYNAMO":
            record.entry = entry
            if entry is not None:
                self._frame_entry.setdefault(frame, entry)
            self._finished[record.compile_id] = record
        stats = self._stats(self._label(entry))
        stats.compile_time_s += record.seconds
        stats.cache_hits += record.cache_hits
        stats.cache_misses += record.cache_misses
        if record.cudagraph_skips:
            self._cudagraph_skips_seen += record.cudagraph_skips
            self.event_log.cudagraph_skip(stats, record, metric)
        if record.trigger != "DYNAMO":
            forward = self._finished.get(record.compile_id)
            if forward is not None and forward.recompile:
                stats.recompile_time_s += record.seconds
            return
        if getattr(metric, "fail_type", None) and record.phase.startswith(WARMUP_PHASE):
            # a bucket warm-up trace that failed (shapes.bucket_warmup reports it): nothing compiled or ran eagerly
            log.debug("warm-up trace of region %s failed: %s", stats.label, getattr(metric, "fail_reason", ""))
            return
        stats.compiles += 1
        stats.graphs += record.graphs
        self.unique_graphs += record.graphs
        function = (frame, record.functions)  # a frame's code, as the function it serves
        modes = self._grad_modes.setdefault(function, set())
        first_compile = not modes  # of this function (attempt > 0: its code served another function first)
        reason = guard_text(getattr(metric, "recompile_reason", None)) if attempt > 0 else ""
        grad_mode_variant = not first_compile and (
            record.grad_enabled not in modes or self._requires_grad_variant(function, record.grad_enabled, reason)
        )
        modes.add(record.grad_enabled)
        if grad_mode_variant:
            stats.grad_mode_variants += 1
        elif not first_compile:
            reason = reason or "unknown guard (no compilation metrics)"
            if reason.startswith(compat.GRAD_MODE_GUARD):
                # Dynamo names one failed guard, of the graph it checked first: another grad mode's. The graph of
                # this grad mode failed a guard it does not name.
                reason = (
                    "a guard of the graph for this grad mode failed; Dynamo names only another graph's "
                    f"({reason}): TORCH_LOGS=recompiles_verbose shows every failed guard"
                )
            record.recompile = not record.phase.startswith(WARMUP_PHASE)
            if record.recompile:
                stats.recompiles += 1
                stats.recompile_time_s += record.seconds
                fix = recompile_fix(reason, len(stats.modules))
                self.event_log.add("recompile", stats.label, record, reason, fix=fix)
            self.event_log.warn_near_limit(frame, attempt, stats, reason)
        for item in record.breaks:
            self.event_log.graph_break(stats, record, item)
        if getattr(metric, "fail_type", None):
            self._failure(entry, record.compile_id, attempt, metric, record.phase, record.step)

    def _requires_grad_variant(self, function: Tuple[str, Tuple[int, ...]], grad_enabled: bool, reason: str) -> bool:
        """Whether a recompile is the function's first for inputs that differ from its graph's in requiring grad
        (under this grad mode): a shared block entry whose first block is fed the batch, the later ones activations."""
        variant = (function, grad_enabled)
        if not compat.REQUIRES_GRAD_GUARD.match(reason) or variant in self._requires_grad_variants:
            return False
        self._requires_grad_variants.add(variant)
        return True

    def _runtime_cudagraph_skips(self) -> None:
        """Skips that Inductor counted outside any compile (when a graph ran): their region is unknown."""
        skipped = compat.cudagraph_skips() - self._cudagraph_skips_seen
        if skipped <= 0:
            return
        self._cudagraph_skips_seen += skipped
        self.runtime_cudagraph_skips += skipped
        self.event_log.runtime_cudagraph_skips(skipped, Where("-", self.phase, self.step))

    def _failure(
        self, entry: Optional[str], compile_id: str, attempt: int, metric: Any, phase: str, step: Optional[int]
    ) -> None:
        stats = self._stats(self._label(entry))
        self.event_log.failure(stats, Where(compile_id, phase, step), attempt, metric)

    # -- reports ------------------------------------------------------------------------------------

    def graph_breaks(self) -> List[GraphBreak]:
        """Distinct graph breaks; one without a location is dropped when the same break has one."""
        located = {(b.region, b.reason) for b in self.breaks.values() if b.location}
        return [b for b in self.breaks.values() if b.location or (b.region, b.reason) not in located]

    def owner(self, location: str) -> str:
        """The modules whose ``forward`` holds ``location`` (``file:line``), e.g. ``model.blocks.0 (Block)``."""
        return owning_modules(self.root, location)

    def totals(self) -> Dict[str, Any]:
        """The compile headline numbers (stable keys; see docs/telemetry.md)."""
        self._count_graph_breaks()
        return {
            "compile_time_s": self.compile_time_s,
            "compiles": sum(s.compiles for s in self.regions.values()),
            "recompiles": sum(s.recompiles for s in self.regions.values()),
            "grad_mode_variants": sum(s.grad_mode_variants for s in self.regions.values()),
            "graph_breaks": sum(s.graph_breaks for s in self.regions.values()),
            "declared_graph_breaks": sum(s.declared_graph_breaks for s in self.regions.values()),
            "unique_graphs": self.unique_graphs,
            "recompile_limit_hits": sum(s.limit_hits for s in self.regions.values()),
            "eager_fallbacks": sum(1 for e in self.events if e.kind == "eager_fallback"),
            "cudagraph_skips": sum(s.cudagraph_skips for s in self.regions.values()) + self.runtime_cudagraph_skips,
        }

    def region_rows(self) -> List[Dict[str, Any]]:
        return [asdict(stats) for stats in self.regions.values()]

    def format_report(self) -> str:
        """Regions, graph breaks and recompiles as fixed-width text (``compile_report.format_compile_report``)."""
        return format_compile_report(self)
