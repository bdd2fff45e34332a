"""The sweep report as text or Markdown: the headline, the runs ranked in a table, the medians over seeds, the
recommendation and the flags."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional

from compile_trainer.runs.report import Report, median, steps_text
from compile_trainer.runs.results import OBJECTIVES, final_loss, objective_value
from compile_trainer.runs.sweep_runs import cold_compile_time
from compile_trainer.tables import text_table

COLUMNS = (
    "#",
    "policy",
    "status",
    "compile s",
    "cache",
    "cold compile s",
    "steady {unit}/s",
    "vs none",
    "pays off after",
    "recompiles",
    "grad-mode variants",
    "graph breaks",
    "peak mem GiB",
    "final loss",
    "loss vs none",
)
REPEAT_COLUMNS = ("setting", "runs ok", "compile s", "steady {unit}/s", "spread", "vs none", "flagged runs")


def titles(columns: Iterable[str], report: Report) -> List[str]:
    """Column titles with the unit the report's runs count (``Report.throughput_unit``)."""
    return [column.format(unit=report.throughput_unit) for column in columns]


def report_text(report: Report, plot: Optional[Path] = None) -> str:
    """The report as fixed-width text; ``plot``: where its plot was written, if it was."""
    table = text_table(titles(COLUMNS, report), run_rows(report))
    flags = flag_lines(report)
    parts = [*headline(report), "", *table, ""]
    if report.repeated:
        parts += ["Over the seeds (medians):", *text_table(titles(REPEAT_COLUMNS, report), repeat_rows(report)), ""]
    parts.append(report.recommendation())
    if flags:
        parts += ["Flags:", *(f"  - {f}" for f in flags)]
    if plot is not None:
        parts.append(f"Plot: {plot}")
    return "\n".join(parts)


def report_markdown(report: Report, plot: Optional[Path] = None) -> str:
    """The report as Markdown (to paste into docs/), the plot as an image beside it."""

    def cells(values: Iterable) -> str:
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    table = [cells(titles(COLUMNS, report)), cells("---" for _ in COLUMNS), *(cells(r) for r in run_rows(report))]
    parts = [*(f"- {line}" for line in headline(report)), "", *table, ""]
    if report.repeated:
        repeats = [cells(titles(REPEAT_COLUMNS, report)), cells("---" for _ in REPEAT_COLUMNS)]
        parts += ["Over the seeds (medians):", "", *repeats, *(cells(r) for r in repeat_rows(report)), ""]
    parts.append(report.recommendation())
    flags = flag_lines(report)
    if flags:
        parts += ["", "Flags:", "", *(f"- {f}" for f in flags)]
    if plot is not None:
        parts += ["", f"![compile time against steady throughput]({plot.name})"]
    return "\n".join(parts)


def headline(report: Report) -> List[str]:
    counts = {status: sum(run.status == status for run in report.runs) for status in ("ok", "failed", "no result")}
    names = sorted({str(((run.result or {}).get("sweep") or {}).get("name")) for run in report.runs} - {"None"})
    objective = OBJECTIVES[report.objective]
    unit = f" ({report.throughput_unit}/s)" if report.objective == "throughput" else ""
    return [
        f"Sweep {', '.join(names) or '-'} in {report.directory}: {len(report.runs)} runs, {counts['ok']} ok, "
        f"{counts['failed']} failed, {counts['no result']} without a result",
        *environment_lines(report),
        report.equal_comparison(),
        f"Ranked by {report.objective}: {objective.description}{unit}, "
        f"{'higher' if objective.maximize else 'lower'} is better.",
    ]


def environment_lines(report: Report) -> List[str]:
    seen = report.environments()
    if len(seen) <= 1:
        return [f"Device: {device}; {versions}" for device, versions in seen] or ["Device: unknown"]
    return [f"Device: {device}; {versions} (runs: {', '.join(runs)})" for (device, versions), runs in seen.items()]


def run_rows(report: Report) -> List[List[str]]:
    """One row per run (``COLUMNS``), in the report's ranking."""
    rows = []
    for rank, run in enumerate(report.ranked, 1):
        ok = run.ok
        peak = run.summary("peak_memory_bytes")
        loss = final_loss(run.result) if ok else None
        change = report.loss_change(run)
        rows.append(
            [
                str(rank),
                run.label,
                f"failed: {run.result['error']['type']}" if run.status == "failed" else run.status,
                _fmt(run.summary("compile_time_s") if ok else None, "{:,.1f}"),
                run.summary("cache_status") or "-",
                _fmt(cold_compile_time(run.result) if ok else None, "{:,.1f}"),
                _fmt(objective_value(run.result, "throughput") if ok else None, "{:,.0f}"),
                _fmt(report.speedup(run), "{:.2f}x"),
                steps_text(report.payback_steps(run)),
                _fmt(run.summary("recompiles") if ok else None, "{:d}"),
                _fmt(run.summary("grad_mode_variants") if ok else None, "{:d}"),
                _fmt(run.summary("graph_breaks") if ok else None, "{:d}"),
                _fmt(peak / 2**30 if peak is not None else None, "{:.2f}"),
                _fmt(loss, "{:.4f}"),
                _fmt(change, "{:+.2%}"),
            ]
        )
    return rows


def repeat_rows(report: Report) -> List[List[str]]:
    """One row per setting (``REPEAT_COLUMNS``), best median objective first: medians over its finished runs, and
    their spread."""
    rows = []
    for setting, runs in report.ranked_settings():
        done = [run for run in runs if run.ok]
        throughput = [objective_value(run.result, "throughput") for run in done]
        throughput = [value for value in throughput if value is not None]
        rows.append(
            [
                setting,
                f"{len(done)}/{len(runs)}",
                _fmt(median([run.summary("compile_time_s") for run in done]), "{:,.1f}"),
                _fmt(median(throughput), "{:,.0f}"),
                f"{min(throughput):,.0f}-{max(throughput):,.0f}" if len(throughput) > 1 else "-",
                _fmt(median([report.speedup(run) for run in done]), "{:.2f}x"),
                str(sum(len(run.flags) > 0 for run in runs)),
            ]
        )
    return rows


def flag_lines(report: Report) -> List[str]:
    return [f"{run.label}: {flag}" for run in report.ranked for flag in run.flags] + report.notes


def _fmt(value: Optional[float], pattern: str) -> str:
    if value is None:
        return "-"
    return pattern.format(int(value)) if pattern == "{:d}" else pattern.format(value)
