"""Regenerate ``docs/BENCHMARKS.md`` (and its plots) from the result files in ``benchmarks/results/``.

    python benchmarks/make_report.py

Every figure in the page comes from a result file written by a benchmark script; each section states the
device, versions, date and command of the run that measured it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
# Sections in this order; other result files follow alphabetically.
ORDER = [
    "train_step",
    "train_step_goal",
    "train_step_lightning_device_data",
    "train_step_kernel_profile",
    "optimizer",
    "dynamic_shapes",
    "telemetry_overhead",
]
PHASES = ("total_wall_time", "entire_frame_compile", "entire_backward_compile", "backend_compile", "code_gen")
SKIP_COLUMNS = {"compile_breakdown", "syncs_in_timed_steps", "host_profile", "compile_kwargs", "compile_phases_s"}


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:200].replace("|", "/")
    return str(value).replace("|", "/")


def markdown_table(columns: List[str], rows: List[Dict[str, Any]]) -> List[str]:
    columns = [c for c in columns if c not in SKIP_COLUMNS and any(c in row for row in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def meta_line(meta: Dict[str, Any]) -> str:
    return (
        f"Measured on {meta.get('device')} with torch {meta.get('torch')}, triton {meta.get('triton', '-')}, "
        f"on {meta.get('date', '-')}; command: `{meta.get('command', '-')}`"
    )


def section(name: str, result: Dict[str, Any]) -> List[str]:
    if "rows" in result:
        lines = [
            f"## {result.get('title', name)}",
            "",
            f"`benchmarks/results/{name}.json`. {meta_line(result['meta'])}",
            "",
        ]
        lines += markdown_table(result["columns"], result["rows"])
        lines += [""] + [f"- {note}" for note in result.get("notes", [])]
        details = [r for r in result["rows"] if r.get("compile_breakdown") or r.get("host_profile")]
        for row in details:
            if row.get("compile_breakdown"):
                phases = {k: row["compile_breakdown"][k] for k in PHASES if k in row["compile_breakdown"]}
                lines.append(f"- {row['variant']}: compile seconds by phase {cell(phases)}")
            if row.get("host_profile"):
                lines.append(f"- {row['variant']}: " + "; ".join(row["host_profile"][:8]))
        return lines + [""]
    # a flat result: one row of its scalar fields
    scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    lines = [f"## {name}", "", f"`benchmarks/results/{name}.json`.", ""]
    lines += ["| field | value |", "|---|---|"] + [f"| {k} | {cell(v)} |" for k, v in scalars.items()]
    return lines + [""]


def train_step_plot(result: Dict[str, Any], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        marker = "s" if row["loop"] == "lightning" else "o"
        color = ax.scatter(row["first_step_s"], row["tokens_per_s"] / 1e3, marker=marker).get_facecolor()[0]
        ax.annotate(
            row["variant"],
            (row["first_step_s"], row["tokens_per_s"] / 1e3),
            fontsize=8,
            xytext=(4, 3),
            textcoords="offset points",
        )
        if row.get("compiled_after_s"):  # a background compile: eager from the first step, compiled from here
            ax.plot([row["first_step_s"], row["compiled_after_s"]], [row["tokens_per_s"] / 1e3] * 2, ":", color=color)
            ax.scatter(
                row["compiled_after_s"], row["tokens_per_s"] / 1e3, marker=marker, facecolors="none", edgecolors=color
            )
    ax.set_xlabel("first step, fresh compile cache (s); hollow: background compile in use")
    ax.set_ylabel("steady throughput (k tokens/s)")
    ax.set_title(f"Cold start vs throughput, {result['meta']['device']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=DOCS / "BENCHMARKS.md")
    args = parser.parse_args()
    files = {p.stem: json.loads(p.read_text()) for p in sorted(args.results.glob("*.json"))}
    names = [n for n in ORDER if n in files] + sorted(n for n in files if n not in ORDER)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/make_report.py` from `benchmarks/results/*.json`; do not edit by hand.",
        "What the numbers mean and what was decided from them: docs/regional.md, docs/optimizer.md,",
        "docs/dynamic_shapes.md, docs/telemetry.md.",
        "",
    ]
    for name in names:
        lines += section(name, files[name])
        commentary = args.results / f"{name}.md"  # what the numbers say, written by whoever ran it
        if commentary.exists():
            lines += [commentary.read_text().strip(), ""]
        if name == "train_step" and train_step_plot(files[name], args.out.parent / "train_step.png"):
            lines += ["![cold start vs throughput](train_step.png)", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out} ({len(names)} benchmarks)")


if __name__ == "__main__":
    main()
