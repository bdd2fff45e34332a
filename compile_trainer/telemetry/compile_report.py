"""The compile report: what ``CompileTelemetry`` collected (regions, graph breaks, recompiles and fallbacks) as
fixed-width text, for the end of a run, ``compile-trainer explain`` and the benchmarks."""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from compile_trainer.tables import text_table
from compile_trainer.telemetry.fixes import suggest_fix
from compile_trainer.telemetry.region_attribution import owning_modules

if TYPE_CHECKING:
    from compile_trainer.telemetry.compile_events import CompileTelemetry

REGION_COLUMNS = (
    "region",
    "modules",
    "compiles",
    "recompiles",
    "grad-mode variants",
    "graphs",
    "breaks",
    "compile s",
    "of it recompiles",
    "cache hit/miss",
)


def format_compile_report(telemetry: CompileTelemetry) -> str:
    """Regions, graph breaks and recompiles as fixed-width text."""
    lines = ["compile telemetry"]
    rows = [
        (
            s.label,
            str(len(s.modules)) if s.modules else "-",
            str(s.compiles),
            str(s.recompiles),
            str(s.grad_mode_variants),
            str(s.graphs),
            str(s.graph_breaks),
            f"{s.compile_time_s:.2f}",
            f"{s.recompile_time_s:.2f}",
            f"{s.cache_hits}/{s.cache_misses}",
        )
        for s in telemetry.regions.values()
    ]
    lines += text_table(REGION_COLUMNS, rows)
    lines += _graph_break_lines(telemetry)
    others = [e for e in telemetry.events if e.kind != "graph_break"]
    if others:
        lines.append(f"recompiles and fallbacks: {len(others)}")
        for event in others:
            when = f"{event.phase} step {event.step}" if event.step is not None else event.phase
            lines.append(f"  - {event.kind} of {event.region} ({event.compile_id}, {when}): {event.reason}")
            lines.append(f"    fix: {event.fix}")
    return "\n".join(lines)


def _graph_break_lines(telemetry: CompileTelemetry) -> List[str]:
    breaks = telemetry.graph_breaks()
    lines = [f"graph breaks: {len(breaks)}"]
    for item in breaks:
        owner = owning_modules(telemetry.root, item.location)
        tag = " [declared: eager rule]" if item.declared else ""
        lines.append(f"  - {item.location or '?'} in {item.function or '?'}{tag}")
        lines.append(f"    region {item.region}" + (f", module {owner}" if owner else ""))
        lines.append(f"    reason: {item.short_reason}")
        if not item.declared:
            lines.append(f"    fix: {suggest_fix('graph_break', item.reason)}")
    return lines
