"""The compile events of a run, each with the knob that fixes it and logged once, when it happens."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from compile_trainer import compat
from compile_trainer.telemetry.compile_records import (
    CompileEvent,
    CompileRecord,
    GraphBreak,
    RegionStats,
    Where,
    first_line,
    guard_text,
)
from compile_trainer.telemetry.fixes import recompile_fix, suggest_fix
from compile_trainer.telemetry.region_attribution import user_frame

log = logging.getLogger(__name__)


class CompileEventLog:
    """Recompiles, graph breaks (the distinct ones kept, with how often Dynamo met them), frames that fell back to
    eager, recompile-limit hits and graphs that run without CUDA graphs. Each event counts in its region's stats
    (recompiles and graph breaks excepted: the telemetry counts those, warm-up aside, and breaks once each).

    ``where`` arguments have a ``compile_id``, a ``phase`` and a ``step``: a compile's record or a ``Where``.
    """

    def __init__(self, declared: List[str]):
        self.events: List[CompileEvent] = []
        self.breaks: Dict[Tuple[str, str, str], GraphBreak] = {}
        self._declared = declared  # qualified names of forwards that `eager` rules disabled: their breaks are declared
        self._frame_warned: set = set()

    def add(
        self, kind: str, label: str, where: Any, reason: str, location: str = "", fix: Optional[str] = None
    ) -> CompileEvent:
        """Record an event. ``fix`` defaults to one for ``reason``."""
        event = CompileEvent(
            kind=kind,
            region=label,
            phase=where.phase,
            step=where.step,
            compile_id=where.compile_id,
            reason=reason,
            location=location,
            fix=suggest_fix(kind, reason) if fix is None else fix,
        )
        self.events.append(event)
        return event

    def cudagraph_skip(self, stats: RegionStats, record: CompileRecord, metric: Any) -> None:
        """Graphs of a compile that run without the CUDA graphs they were asked for (``record.cudagraph_skips``)."""
        stats.cudagraph_skips += record.cudagraph_skips
        reason = str(getattr(metric, "cudagraph_skip_reason", None) or "") or (
            "reason not reported by Inductor (it reports it only for graphs on a CUDA device)"
        )
        event = self.add("cudagraph_skip", stats.label, record, first_line(reason))
        log.warning("region %s runs without CUDA graphs: %s. Fix: %s", stats.label, event.reason, event.fix)

    def runtime_cudagraph_skips(self, skipped: int, where: Where) -> None:
        """Skips counted outside any compile: CUDA graph trees give up on a graph when it runs (an input
        mutated outside the graphs' memory, too many re-recordings), and say why only in a log that is off
        by default."""
        reason = f"{skipped} graph(s) stopped using CUDA graphs at run time (TORCH_LOGS=cudagraphs shows why)"
        event = self.add("cudagraph_skip", "-", where, reason)
        log.warning("%s. Fix: %s", reason, event.fix)

    def graph_break(self, stats: RegionStats, record: CompileRecord, item: Any) -> None:
        """One of Dynamo's ``GraphCompileReason``s met in a compile of the region."""
        reason = str(getattr(item, "reason", item))
        frame = user_frame(list(getattr(item, "user_stack", []) or []))
        location = f"{frame.filename}:{frame.lineno}" if frame is not None else ""
        function = frame.name if frame is not None else ""
        key = (stats.label, reason, location)
        if key not in self.breaks:
            declared = "torch.compiler.disable" in reason and any(name in reason for name in self._declared)
            self.breaks[key] = GraphBreak(stats.label, reason, location, function, declared, step=record.step)
            fix = suggest_fix("graph_break", reason)
            event = self.add("graph_break", stats.label, record, first_line(reason), location, fix)
            log.log(
                logging.INFO if declared else logging.WARNING,
                "graph break in region %s at %s: %s%s",
                stats.label,
                location or "?",
                first_line(reason),
                " (declared by an eager rule)" if declared else f". Fix: {event.fix}",
            )
        self.breaks[key].count += 1

    def failure(self, stats: RegionStats, where: Where, attempt: int, metric: Any) -> None:
        """A compile that failed: the region hit the recompile limit, or a frame fell back to eager."""
        label = stats.label
        reason = str(getattr(metric, "fail_reason", "") or "")
        limit = compat.recompile_limit()
        if compat.is_recompile_limit(reason) or attempt >= limit:
            stats.limit_hits += 1
            guard = guard_text(getattr(metric, "recompile_reason", None)) or "unknown"
            event = self.add("recompile_limit", label, where, guard, fix=recompile_fix(guard, len(stats.modules)))
            log.error(
                "region %s hit recompile_limit=%d: Dynamo now runs it EAGERLY, without the compiled speed-up. "
                "The guard that kept failing: %s. Fix: %s.",
                label,
                limit,
                guard,
                event.fix,
            )
            return
        filename = getattr(metric, "co_filename", None) or ""
        location = f"{filename}:{getattr(metric, 'co_firstlineno', '')}" if filename else ""
        event = self.add(
            "eager_fallback", label, where, first_line(reason), location, suggest_fix("eager_fallback", reason)
        )
        log.warning(
            "region %s: frame %s (%s) fell back to eager: %s. Fix: %s",
            label,
            getattr(metric, "co_name", "?"),
            location,
            first_line(reason),
            event.fix,
        )

    def warn_near_limit(self, frame: str, attempt: int, stats: RegionStats, reason: str) -> None:
        """Warn once per frame when its recompiles reach half the recompile limit."""
        limit = compat.recompile_limit()
        if attempt >= max(1, limit // 2) and frame not in self._frame_warned and attempt < limit:
            self._frame_warned.add(frame)
            log.warning(
                "region %s has recompiled %d times (recompile_limit=%d; past it the region runs eagerly). "
                "Last guard that failed: %s. Fix: %s.",
                stats.label,
                attempt,
                limit,
                reason,
                recompile_fix(reason, len(stats.modules)),
            )
