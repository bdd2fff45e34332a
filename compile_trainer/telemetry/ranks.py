"""Compile telemetry across ranks: each rank's compile time and recompiles gathered to every rank, their spread,
and the ranks whose recompiles diverge from the others' (a rank recompiling alone stalls the collectives of all).

``rank_report`` is pure (a list of per-rank summaries in, a dict out); ``gather_rank_summaries`` needs an
initialized ``torch.distributed`` process group and is a no-op without one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist

RANK_KEYS = (
    "compile_time_s", "compiles", "recompiles", "graph_breaks", "unique_graphs", "first_step_time_s",
    "steady_step_time_median_s", "peak_memory_bytes",
)  # fmt: skip


def gather_rank_summaries(summary: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Every rank's ``RANK_KEYS`` of its summary, by rank (a collective: call it on every rank); ``None`` on one
    process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    mine = {key: summary.get(key) for key in RANK_KEYS}
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def divergent_ranks(values: Sequence[Any]) -> List[int]:
    """The ranks whose value differs from the most common one (all of them but the first of a tie)."""
    if len(set(values)) <= 1:
        return []
    common = Counter(values).most_common(1)[0][0]
    return [rank for rank, value in enumerate(values) if value != common]


def rank_report(summaries: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Headline numbers across ranks: min/max compile time and first step; first step, median steady step,
    recompiles, graphs and peak memory by rank; the ranks whose recompiles diverge."""
    report: Dict[str, Any] = {"ranks": len(summaries)}
    for key in ("compile_time_s", "first_step_time_s"):
        values = [s.get(key) for s in summaries if s.get(key) is not None]
        if values:
            report[f"{key}_min"], report[f"{key}_max"] = min(values), max(values)
    recompiles = [s.get("recompiles") or 0 for s in summaries]
    report["recompiles_by_rank"] = recompiles
    report["graphs_by_rank"] = [s.get("unique_graphs") or 0 for s in summaries]
    report["first_step_time_s_by_rank"] = [s.get("first_step_time_s") for s in summaries]
    report["steady_step_time_median_s_by_rank"] = [s.get("steady_step_time_median_s") for s in summaries]
    report["peak_memory_bytes_by_rank"] = [s.get("peak_memory_bytes") for s in summaries]
    report["divergent_recompile_ranks"] = divergent_ranks(recompiles)
    return report


def describe_rank_report(report: Dict[str, Any]) -> str:
    """The report as console lines (rank 0 prints them)."""

    def span(key: str) -> str:
        low, high = report.get(f"{key}_min"), report.get(f"{key}_max")
        return "-" if low is None else f"{low:.2f}-{high:.2f} s"

    lines = [
        f"ranks {report['ranks']}: compile time {span('compile_time_s')} (min-max), "
        f"first step {span('first_step_time_s')}, recompiles by rank {report['recompiles_by_rank']}",
    ]
    memory = report.get("peak_memory_bytes_by_rank") or []
    if any(m is not None for m in memory):
        lines[0] += ", peak memory by rank [" + ", ".join("-" if m is None else f"{m / 2**30:.1f} GiB" for m in memory)
        lines[0] += "]"
    divergent = report["divergent_recompile_ranks"]
    if divergent:
        names = ", ".join(f"rank {r} ({report['recompiles_by_rank'][r]})" for r in divergent)
        lines.append(
            f"  divergent recompiles: {names}: a rank that recompiles alone stalls every collective; declare "
            "dynamic sizes (shapes.dynamic) or turn on distributed.consistent_dynamic_shapes"
        )
    return "\n".join(lines)


def rank_metrics(report: Dict[str, Any]) -> Dict[str, float]:
    """The report as logger metrics (``compile/ranks/...``)."""
    metrics = {f"compile/ranks/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float))}
    metrics["compile/ranks/divergent_recompile_ranks"] = float(len(report["divergent_recompile_ranks"]))
    metrics["compile/ranks/recompiles_max"] = float(max(report["recompiles_by_rank"], default=0))
    return metrics
