"""The sweep report's plot: compile time against steady throughput, one labelled point per finished run."""

from __future__ import annotations

from pathlib import Path

from compile_trainer.runs.report import Report
from compile_trainer.runs.results import objective_value


def plot_report(report: Report, path: Path) -> Path:
    """Write the plot to ``path`` (making its folder); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
    points = [
        (run, run.summary("compile_time_s"), objective_value(run.result, "throughput")) for run in report.runs if run.ok
    ]
    points = [(run, x, y) for run, x, y in points if x is not None and y is not None]
    for run, x, y in points:
        flagged = bool(run.flags)
        axes.scatter([x], [y], color="tab:red" if flagged else "tab:blue", zorder=3)
        axes.annotate(
            run.label + (" (flagged)" if flagged else ""),
            (x, y),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=9,
        )
    if report.baseline is not None and objective_value(report.baseline.result, "throughput"):
        axes.axhline(
            objective_value(report.baseline.result, "throughput"),
            color="gray",
            linestyle="--",
            linewidth=1,
            label=f"{report.baseline.label} (eager baseline)",
        )
        axes.legend(loc="lower right", fontsize=9)
    failed = [run.label for run in report.runs if not run.ok]
    if failed:
        axes.text(
            0.01,
            0.01,
            "not plotted (failed or no result): " + ", ".join(failed),
            transform=axes.transAxes,
            fontsize=8,
            color="tab:red",
            va="bottom",
        )
    axes.set_xlabel("compile time (s)")
    axes.set_ylabel(f"steady throughput ({report.throughput_unit}/s)")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.margins(x=0.2, y=0.15)
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    device = ", ".join(sorted({device for device, _ in report.environments()})) or "unknown device"
    axes.set_title(f"{report.directory.name}: compile time vs throughput\n{device}", fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
