"""Regenerate ``docs/BENCHMARKS.md`` (and its plots) from the result files in ``benchmarks/results/``:
``<benchmark>.json`` (a headline), ``<sweep>/`` (a sweep's ``result.json`` per run), ``experiments/`` (earlier and side
runs, each with an ``"experiment"`` heading; a former headline with ``"changed_since"``), ``<name>.md`` beside a JSON
file (what the numbers say, printed after the table). The page opens with ``report_intro.md`` (beside this script).

    python benchmarks/make_report.py
"""

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
INTRO = Path(__file__).with_name("report_intro.md")  # the page's opening: what it is, how to add a benchmark
EXPERIMENTS = "experiments"
Sections = List[Tuple[str, List[str]]]  # (heading, body lines) in page order
# Headline sections in this order; other headline files follow alphabetically, then the sweeps.
HEADLINE_ORDER = ["real_models", "real_models_as_configured", "hf_varlen", "lightning_dropin", "distributed"]
# Experiment sections grouped by question, in this order; other experiment files follow, newest first.
EXPERIMENT_ORDER = [
    f"train_step_{name}"
    for name in """regional_rest_compile regional_goal_200_steps regional_goal_200_steps_fx_race_failure
    lightning_vs_raw_30_steps_cudagraphs lightning_vs_raw_30_steps_background_autocast_fix
    lightning_vs_raw_30_steps_order_swapped lightning_vs_raw_30_steps_regional
    lightning_vs_raw_30_steps_interval_logging lightning_vs_raw_30_steps_cpp_wrapper lightning_vs_raw_30_steps_repeated
    lightning_vs_raw_200_steps lightning_vs_raw_200_steps_gc_freeze lightning_batches_on_gpu
    lightning_vs_raw_kernel_profile lightning_vs_raw_host_profile slower_host_earlier_full_run""".split()
]
PHASES = ("total_wall_time", "entire_frame_compile", "entire_backward_compile", "backend_compile", "code_gen")
# The files the train-step plot is drawn from: the headline, or while there is none, the former headline.
PLOTTED = ("train_step", "train_step_regional_rest_compile")
SKIP_COLUMNS = {"compile_breakdown", "syncs_in_timed_steps", "host_profile", "compile_kwargs", "compile_phases_s"}
# A sweep's summary figures shown as the median over a policy's runs.
SUMMARY_MEDIANS = "compile_time_s steady_step_time_median_s mfu recompiles graph_breaks peak_memory_bytes".split()


def cell(value: Any) -> str:
    """A value as a table shows it, here and on the console (``common.print_table``)."""
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
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def meta_line(result: Dict[str, Any]) -> str:
    meta = result.get("meta")
    if meta is None:  # a flat result: its script records device and torch at the top level, no date or command
        recorded = result.get("recorded", "the script records neither date nor command")
        return f"Measured on {result.get('device')} with torch {result.get('torch')}; {recorded}."
    return (
        f"Measured on {meta.get('device')} with torch {meta.get('torch')}, triton {meta.get('triton', '-')}, "
        f"on {meta.get('date', '-')}; command: `{meta.get('command', '-')}`"
    )


def headline_line(result: Dict[str, Any]) -> str:
    """What a headline's numbers stand on: the commit that measured them, and one run or medians over repeats."""
    commit = (result.get("meta") or {}).get("commit")
    line = f"Commit `{commit}`." if commit else "Commit not recorded."
    repeats = [row["repeats"] for row in result.get("rows", []) if row.get("repeats")]
    if not repeats:
        return f"{line} Single run, no spread."
    counts = f"{min(repeats)}" if min(repeats) == max(repeats) else f"{min(repeats)}-{max(repeats)}"
    failed = sum(1 for row in result["rows"] if row.get("error") and not row.get("repeats"))
    single = len(result["rows"]) - len(repeats) - failed
    once = f" ({single} row{'s' * (single > 1)} without `repeats`: one run, no spread)" if single else ""
    errors = f" {failed} row{'s' * (failed > 1)} failed: the error column says why." if failed else ""
    return f"{line} Timings and ratios are medians over {counts} fresh runs a row{once}; `spread`: min, max.{errors}"


def changed_line(result: Dict[str, Any]) -> List[str]:
    """A former headline's note: the bundled policy it measured has been redefined since."""
    changed = result.get("changed_since")
    return [f"**Measured on an older definition; what changed since:** {changed}", ""] if changed else []


def result_body(path: str, result: Dict[str, Any], headline: bool) -> List[str]:
    """The lines under a result file's heading: where it is and what measured it, its table, notes."""
    benchmark = result.get("benchmark")
    source = f"`{path}`" + (f" (benchmark `{benchmark}`)" if benchmark else "")
    lines = changed_line(result) + [f"{source}. {meta_line(result)}", ""]
    lines += [headline_line(result), ""] if headline else []
    if "rows" not in result:  # a flat result: one row per scalar field
        skipped = ("title", "recorded", "benchmark")
        scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list)) and k not in skipped}
        return lines + ["| field | value |", "|---|---|"] + [f"| {k} | {cell(v)} |" for k, v in scalars.items()] + [""]
    lines += markdown_table(result["columns"], result["rows"])
    lines += [""] + [f"- {note}" for note in result.get("notes", [])]
    for row in result["rows"]:
        if row.get("compile_breakdown"):
            phases = {k: row["compile_breakdown"][k] for k in PHASES if k in row["compile_breakdown"]}
            lines.append(f"- {row['variant']}: compile seconds by phase {cell(phases)}")
        if row.get("host_profile"):
            lines.append(f"- {row['variant']}: " + "; ".join(row["host_profile"][:8]))
    return lines + [""]


def load_sweep(directory: Path) -> Optional[Dict[str, Any]]:
    """A sweep's runs (``<directory>/<job>/result.json``) and, for a former headline, its ``experiment.json``; or
    None when the directory holds no runs."""
    paths = sorted(directory.glob("*/result.json"), key=lambda p: (len(p.parent.name), p.parent.name))
    about = directory / "experiment.json"
    extra = json.loads(about.read_text()) if about.exists() else {}
    return {"name": directory.name, "runs": [json.loads(p.read_text()) for p in paths], **extra} if paths else None


def sweep_title(sweep: Dict[str, Any]) -> str:
    recipes = sorted({run.get("recipe") or "-" for run in sweep["runs"]})
    policies = ", ".join(dict.fromkeys(run.get("policy") or "-" for run in sweep["runs"]))
    seeds = sorted({run.get("seed") for run in sweep["runs"]}, key=str)
    repeats = f" (seeds {', '.join(map(str, seeds))})" if len(seeds) > 1 else ""
    return f"Policy sweep on the {', '.join(recipes)} recipe: {policies}{repeats}"


def median(values: List[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values: List[Any], digits: int) -> Optional[str]:
    values = [v for v in values if v is not None]
    return f"{min(values):,.{digits}f}-{max(values):,.{digits}f}" if len(values) > 1 else None


def tokens_per_s(summary: Dict[str, Any]) -> Optional[float]:
    """A run's items a step over its median step (the mean rate where the median is not recorded)."""
    mean_rate, mean_step = summary.get("steady_items_per_s"), summary.get("steady_step_time_s")
    median_step = summary.get("steady_step_time_median_s")
    return mean_rate * mean_step / median_step if mean_rate and mean_step and median_step else mean_rate


def sweep_rows(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per policy: the median of its runs (repeats differing in seed) and the spread of the two figures
    a headline compares (tokens/s, first step); ``vs_none`` from the medians."""
    by_policy: Dict[str, List[Dict[str, Any]]] = {}
    for run in runs:
        by_policy.setdefault(run.get("policy") or "-", []).append(run)
    rows = []
    for policy, group in by_policy.items():
        summaries = [run.get("summary", {}) for run in group]
        middle = {key: median([summary.get(key) for summary in summaries]) for key in SUMMARY_MEDIANS}
        tps, first = [tokens_per_s(s) for s in summaries], [s.get("first_step_time_s") for s in summaries]
        step, peak = middle["steady_step_time_median_s"], middle["peak_memory_bytes"]
        row = {"policy": policy, "runs": len(group), "ok": sum(run.get("status") == "ok" for run in group)}
        row |= {"compile_s": middle["compile_time_s"]}
        row |= {"first_step_s": median(first), "first_step_s_spread": spread(first, 2)}
        row |= {"steady_step_ms": None if step is None else step * 1e3}
        row |= {"tokens_per_s": median(tps), "tokens_per_s_spread": spread(tps, 0)}
        row |= {key: middle[key] for key in ("mfu", "recompiles", "graph_breaks")}
        row |= {"peak_mem_gib": None if peak is None else peak / 2**30}
        row |= {"final_val_loss": median([run.get("final_val_loss") for run in group])}
        rows.append(row | {"error": next((run.get("error") for run in group if run.get("error")), None)})
    base = next((row["tokens_per_s"] for row in rows if row["policy"] == "none"), None)
    for row in rows:
        row["vs_none"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return sorted(rows, key=lambda row: -(row["tokens_per_s"] or 0))


def sweep_body(path: str, sweep: Dict[str, Any], out_dir: Path) -> List[str]:
    runs, first = sweep["runs"], sweep["runs"][0]
    environment = first.get("environment", {})
    versions = environment.get("versions", {})
    # the overrides every run shares make the command; the ones that differ are what the sweep varied
    shared = [o for o in first.get("overrides", []) if all(o in run.get("overrides", []) for run in runs)]
    lines = changed_line(sweep) + [
        f"`{path}` ({len(runs)} runs, one `result.json` each). Measured on "
        f"{environment.get('device', {}).get('name')} with torch {versions.get('torch')}, triton "
        f"{versions.get('triton', '-')}, lightning {versions.get('lightning', '-')}, on "
        f"{(first.get('started_at') or '-')[:10]}; command: `{' '.join(['python train.py -m', *shared])}`",
        "",
    ]
    rows = sweep_rows(runs)
    measured = {"meta": {"commit": first.get("commit")}, "rows": [{"repeats": row["runs"]} for row in rows]}
    lines += [] if "changed_since" in sweep else [headline_line(measured), ""]
    lines += markdown_table(list(rows[0]), rows) + [""]
    seeds = ", ".join(map(str, sorted({run.get("seed") for run in runs}, key=str)))
    lines.append(
        f"- {first.get('steps')} steps per run, seeds {seeds} (each policy's row: the median over its runs), "
        f"precision {first.get('precision')}, fresh compile cache: {first.get('fresh_cache')}; tokens/s from the run's "
        "median steady step"
    )
    if (DOCS / f"{sweep['name']}.md").exists():
        lines.append(f"- The full report (`compile-trainer report`) and what was decided: docs/{sweep['name']}.md")
    lines.append("")
    if (out_dir / f"{sweep['name']}.png").exists():  # drawn by `compile-trainer report --plot`, not here
        lines += [f"![compile time against steady throughput]({sweep['name']}.png)", ""]
    return lines


def train_step_plot(result: Dict[str, Any], path: Path) -> bool:
    """Cold start against throughput, a point per train-step row; False where no row has a throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        marker, point = "s" if row["loop"] == "lightning" else "o", (row["first_step_s"], row["tokens_per_s"] / 1e3)
        color = ax.scatter(*point, marker=marker).get_facecolor()[0]
        ax.annotate(row["variant"], point, fontsize=8, xytext=(4, 3), textcoords="offset points")
        if row.get("compiled_after_s"):  # a background compile: eager from the first step, compiled from here
            ax.plot([point[0], row["compiled_after_s"]], [point[1]] * 2, ":", color=color)
            ax.scatter(row["compiled_after_s"], point[1], marker=marker, facecolors="none", edgecolors=color)
    ax.set_xlabel("first step, fresh compile cache (s); hollow: background compile in use")
    ax.set_ylabel("steady throughput (k tokens/s)")
    ax.set_title(f"Cold start vs throughput, {result['meta']['device']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def sections(folder: Path, shown: str, headline: bool, out_dir: Path, plotted: Optional[str]) -> Sections:
    """The result files in ``folder``: headlines alphabetically after ``HEADLINE_ORDER``, experiments newest first
    after ``EXPERIMENT_ORDER``; then the sweeps in its subfolders. The train-step plot goes under ``plotted``."""
    loaded = {p.stem: (p, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))}
    names = sorted(loaded)
    if not headline:  # newest first
        names.sort(key=lambda name: loaded[name][1].get("meta", {}).get("date", ""), reverse=True)
    found = []
    order = HEADLINE_ORDER if headline else EXPERIMENT_ORDER
    for name in [n for n in order if n in names] + [n for n in names if n not in order]:
        path, result = loaded[name]
        title = (result.get("title") or name) if headline else f"{result.get('title', name)} ({name})"
        body = result_body(f"{shown}/{name}.json", result, headline)
        if path.with_suffix(".md").exists():  # what the numbers say, written by whoever ran it
            body += [path.with_suffix(".md").read_text().strip(), ""]
        if name == plotted and "rows" in result and train_step_plot(result, out_dir / "train_step.png"):
            body += ["![cold start vs throughput](train_step.png)", ""]
        found.append((result.get("experiment") or title, body))
    for directory in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != EXPERIMENTS):
        sweep = load_sweep(directory)
        if sweep is not None:
            body = sweep_body(f"{shown}/{directory.name}/", sweep, out_dir)
            found.append((sweep.get("experiment") or sweep_title(sweep), body))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=DOCS / "BENCHMARKS.md")
    args = parser.parse_args()
    out_dir, shown = args.out.parent, "benchmarks/results"  # how the page names the results folder
    out_dir.mkdir(parents=True, exist_ok=True)
    stems = {p.stem for p in [*args.results.glob("*.json"), *(args.results / EXPERIMENTS).glob("*.json")]}
    plotted = next((name for name in PLOTTED if name in stems), None)
    headlines = sections(args.results, shown, True, out_dir, plotted)
    experiments = sections(args.results / EXPERIMENTS, f"{shown}/{EXPERIMENTS}", False, out_dir, plotted)
    seen: Dict[str, int] = {}
    for found in (headlines, experiments):  # no two sections share a heading (nor an anchor)
        for i, (heading, body) in enumerate(found):
            seen[anchor(heading)] = seen.get(anchor(heading), 0) + 1
            if seen[anchor(heading)] > 1:
                found[i] = (f"{heading} ({seen[anchor(heading)]})", body)
    lines = INTRO.read_text().splitlines() + [""]
    for title, found in (("Headlines", headlines), ("Experiments", experiments)):
        lines += [f"## {title}", ""] + [f"- [{heading}](#{anchor(heading)})" for heading, _ in found] + [""]
        for heading, body in found:
            lines += [f"### {heading}", ""] + body
    args.out.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out} ({len(headlines)} headlines, {len(experiments)} experiments)")


if __name__ == "__main__":
    main()
