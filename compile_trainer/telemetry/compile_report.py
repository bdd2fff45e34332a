"""The compile report: what ``CompileTelemetry`` collected (regions, graph breaks, recompiles and fallbacks) as
fixed-width text, for the end of a run, ``compile-trainer explain`` and the benchmarks. Each count means what
``CompileTelemetry.totals()`` means by it (docs/telemetry.md), and the report says so once, under its table."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, List, Sequence

from compile_trainer.tables import text_table
from compile_trainer.telemetry.fixes import suggest_fix
from compile_trainer.telemetry.region_attribution import owning_modules

if TYPE_CHECKING:
    from compile_trainer.telemetry.compile_events import CompileTelemetry
    from compile_trainer.telemetry.compile_records import RegionStats

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
)
CACHE_COLUMN = "cache hit/miss"
# What each column counts, said once under the table.
LEGEND = (
    "modules: those running the region's code",
    "compiles: frames Dynamo compiled (a graph break cuts a function, and each one calling it, into frames, most "
    "without a graph), grad-mode variants and recompiles included",
    "recompiles: after a guard failed",
    "grad-mode variants: a frame's first graph under another grad mode or requires_grad, expected",
    "graphs: the graphs compiled",
    "breaks: distinct graph breaks, the eager rules' declared ones left out",
    "compile s (of it recompiles): seconds compiling (of them, those recompiling)",
)
CACHE_LEGEND = "cache hit/miss: lookups in torch's compile caches (Inductor's FX graphs, AOTAutograd)"
LEGEND_WIDTH = 120


def format_compile_report(telemetry: CompileTelemetry) -> str:
    """Regions, graph breaks and recompiles as fixed-width text."""
    regions = list(telemetry.regions.values())
    if not regions:
        return "compile telemetry: nothing compiled"
    cache = _shows_cache(telemetry, regions)
    rows = [_region_cells(s, cache) for s in regions]
    if len(regions) > 1:
        rows.append(_total_cells(regions, cache))
    lines = ["compile telemetry", *text_table(REGION_COLUMNS + ((CACHE_COLUMN,) if cache else ()), rows)]
    lines += textwrap.wrap(
        "; ".join([*LEGEND, *([CACHE_LEGEND] if cache else [])]), LEGEND_WIDTH, break_on_hyphens=False
    )
    lines += _graph_break_lines(telemetry)
    others = [e for e in telemetry.events if e.kind != "graph_break"]
    if others:
        lines.append(f"recompiles and fallbacks: {len(others)}")
        for event in others:
            when = f"{event.phase} step {event.step}" if event.step is not None else event.phase
            lines.append(f"  - {event.kind} of {event.region} ({event.compile_id}, {when}): {event.reason}")
            lines.append(f"    fix: {event.fix}")
    return "\n".join(lines)


def _shows_cache(telemetry: CompileTelemetry, regions: Sequence[RegionStats]) -> bool:
    """Whether the cache column says anything: the policy keeps a compile cache, or a cache served a compile."""
    applied = telemetry.applied
    return (applied is not None and applied.policy.cache.active) or any(s.cache_hits for s in regions)


def _region_cells(s: RegionStats, cache: bool) -> List[str]:
    cells = [
        s.label,
        str(len(s.modules)) if s.modules else "-",
        str(s.compiles),
        str(s.recompiles),
        str(s.grad_mode_variants),
        str(s.graphs),
        str(s.graph_breaks),
        f"{s.compile_time_s:.2f}",
        f"{s.recompile_time_s:.2f}",
    ]
    return cells + ([f"{s.cache_hits}/{s.cache_misses}"] if cache else [])


def _total_cells(regions: Sequence[RegionStats], cache: bool) -> List[str]:
    """The table's last row: each column summed over the regions (what ``CompileTelemetry.totals()`` reports)."""

    def total(field: str) -> int:
        return sum(getattr(s, field) for s in regions)

    cells = [
        "total",
        str(sum(len(s.modules) for s in regions)),
        *(str(total(f)) for f in ("compiles", "recompiles", "grad_mode_variants", "graphs", "graph_breaks")),
        f"{sum(s.compile_time_s for s in regions):.2f}",
        f"{sum(s.recompile_time_s for s in regions):.2f}",
    ]
    return cells + ([f"{total('cache_hits')}/{total('cache_misses')}"] if cache else [])


def _graph_break_lines(telemetry: CompileTelemetry) -> List[str]:
    """The distinct graph breaks: the count is ``totals()``'s (no declared one), the declared ones said apart."""
    breaks = telemetry.graph_breaks()
    declared = sum(1 for item in breaks if item.declared)
    expected = f" (and {declared} declared by an eager rule, expected)" if declared else ""
    lines = [f"graph breaks: {len(breaks) - declared}{expected}"]
    for item in breaks:
        owner = owning_modules(telemetry.root, item.location)
        tag = " [declared: eager rule]" if item.declared else ""
        lines.append(f"  - {item.location or '?'} in {item.function or '?'}{tag}")
        lines.append(f"    region {item.region}" + (f", module {owner}" if owner else ""))
        lines.append(f"    reason: {item.short_reason}")
        if not item.declared:
            lines.append(f"    fix: {suggest_fix('graph_break', item.reason)}")
    return lines
