"""``compile-trainer report <multirun dir>``: a sweep's runs side by side, ranked, and which policy to use.

Reads the ``result.json`` files that ``train.py`` writes (never W&B's servers). Runs that failed are
listed with their error and runs that left no result (still running, killed) with their overrides:
no run is dropped silently. Speedups, payback and the loss check are against the sweep's eager
baseline: a ``none`` run (nothing compiled, optimizer included). Runs that differ only in ``seed`` are repeats:
each is compared with the baseline and the runs of its own seed, and a table of medians over the seeds (with
their spread) ranks the settings; the recommendation then comes from it. Needs neither Hydra nor W&B.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from compile_trainer.runs.results import OBJECTIVES, RESULT_FILE, final_loss, objective_value, read_result
from compile_trainer.tables import text_table

DEFAULT_LOSS_TOLERANCE = 0.02
PLOT_FILE = "report.png"
# What must be equal for runs to be compared: name in the report, key in the result file, and whether
# only a finished run has it (a run that failed early has no steps and no Trainer).
COMPARED = (
    ("seed", "seed", False),
    ("recipe", "recipe", False),
    ("data settings", "data", False),
    ("model settings", "model", False),
    ("Inductor cache", "fresh_cache", False),
    ("steps", "steps", True),
    ("precision", "precision", True),
)
COLUMNS = (
    "#",
    "policy",
    "status",
    "compile s",
    "cache",
    "cold compile s",
    "steady tokens/s",
    "vs none",
    "pays off after",
    "recompiles",
    "grad-mode variants",
    "graph breaks",
    "peak mem GiB",
    "final loss",
    "loss vs none",
)
REPEAT_COLUMNS = ("setting", "runs ok", "compile s", "steady tokens/s", "spread", "vs none", "flagged runs")


def cold_compile_time(result: Dict[str, Any]) -> Optional[float]:
    """The compile time without a compile-cache bundle: the bundle's cold compile for a run that loaded one, the
    run's own compile time for a run that had none (its compile s is then its cold compile)."""
    summary = result.get("summary") or {}
    if summary.get("cache_status") == "hit":
        return summary.get("cache_cold_compile_s")
    return summary.get("compile_time_s") if summary.get("cache_status") in ("miss", "unusable") else None


class ReportError(ValueError):
    """A directory that holds no runs to report on."""


@dataclass
class Run:
    """One run of the sweep: its result, or ``None`` where it left no result file."""

    directory: Path
    overrides: List[str]
    result: Optional[Dict[str, Any]] = None
    label: str = ""
    flags: List[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.result["status"] if self.result is not None else "no result"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def job(self) -> float:
        sweep = (self.result or {}).get("sweep") or {}
        if sweep.get("job") is not None:
            return sweep["job"]
        return int(self.directory.name) if self.directory.name.isdigit() else math.inf

    @property
    def policy(self) -> str:
        if self.result is not None:
            return str(self.result.get("policy"))
        return dict(_split(o) for o in self.overrides).get("compile", "?")

    @property
    def seed(self) -> Any:
        if self.result is not None:
            return self.result.get("seed")
        return dict(_split(o) for o in self.overrides).get("seed")

    @property
    def setting(self) -> str:
        """The label without the seed: the runs of one setting are repeats."""
        return " ".join(word for word in self.label.split(" ") if not word.startswith(("seed=", "#")))

    def summary(self, key: str) -> Optional[float]:
        return ((self.result or {}).get("summary") or {}).get(key)


def _split(override: str) -> Tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _read_overrides(path: Path) -> List[str]:
    import yaml

    return [str(override) for override in yaml.safe_load(path.read_text()) or []]


def find_runs(directory: Path) -> List[Run]:
    """Every run under ``directory``: those with a result file, and Hydra job directories without one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory; give a multirun directory (multirun/<sweep name>)")
    runs = []
    for path in sorted(directory.rglob(RESULT_FILE)):
        result = read_result(path)
        runs.append(Run(path.parent, list(result.get("overrides") or []), result))
    reported = {run.directory for run in runs}
    for overrides in sorted(directory.rglob(".hydra/overrides.yaml")):
        job_dir = overrides.parent.parent
        if job_dir not in reported:
            runs.append(Run(job_dir, _read_overrides(overrides)))
    if not runs:
        raise ReportError(
            f"no runs under {directory}: expected {RESULT_FILE} files written by `python train.py -m ...`"
        )
    runs.sort(key=lambda run: (run.job, str(run.directory)))
    _label(runs)
    return runs


def _label(runs: List[Run]) -> None:
    """Name each run by its policy and the overrides that differ between the runs."""
    settings = [dict(_split(o) for o in run.overrides) for run in runs]
    keys = sorted({key for s in settings for key in s})
    varying = [k for k in keys if k != "compile" and len({s.get(k) for s in settings}) > 1]
    for run, values in zip(runs, settings):
        extra = [f"{key.removeprefix('compile.')}={values[key]}" for key in varying if key in values]
        run.label = " ".join([run.policy, *extra])
    seen: Dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label += f" #{run.directory.name}"


def is_baseline(result: Dict[str, Any]) -> bool:
    """Nothing compiled: the policy is off and so is the optimizer's compilation."""
    settings = result.get("policy_settings") or {}
    optimizer = str((settings.get("optimizer") or {}).get("compile", "false")).lower()
    return result.get("status") == "ok" and settings.get("enabled") is False and optimizer == "false"


@dataclass
class Report:
    """A sweep's runs, ranked by ``objective``, with the baseline comparisons and the flags."""

    directory: Path
    runs: List[Run]
    objective: str = "throughput"
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE
    baseline: Optional[Run] = None
    notes: List[str] = field(default_factory=list)
    baselines: Dict[Any, Run] = field(default_factory=dict)  # seed -> that seed's eager baseline

    @property
    def seeds(self) -> List[Any]:
        return sorted({run.seed for run in self.runs if run.result is not None}, key=str)

    def by_setting(self) -> Dict[str, List[Run]]:
        """The runs of each setting (label without the seed): a setting's runs are repeats."""
        settings: Dict[str, List[Run]] = {}
        for run in self.runs:
            settings.setdefault(run.setting, []).append(run)
        return settings

    @property
    def repeated(self) -> bool:
        """Some setting ran with more than one seed."""
        return any(len({run.seed for run in runs}) > 1 for runs in self.by_setting().values())

    def baseline_for(self, run: Run) -> Optional[Run]:
        """The eager baseline of the run's seed, else the sweep's."""
        return self.baselines.get(run.seed, self.baseline)

    @property
    def ranked(self) -> List[Run]:
        maximize = OBJECTIVES[self.objective].maximize

        def key(run: Run) -> Tuple[int, float, float]:
            value = objective_value(run.result, self.objective) if run.ok else None
            group = 0 if value is not None else 1 if run.ok else 2 if run.status == "failed" else 3
            return group, (-value if maximize else value) if value is not None else 0.0, run.job

        return sorted(self.runs, key=key)

    # -- numbers --------------------------------------------------------------------------------------

    def speedup(self, run: Run) -> Optional[float]:
        baseline = self.baseline_for(run)
        base = objective_value(baseline.result, "throughput") if baseline else None
        value = objective_value(run.result, "throughput") if run.ok else None
        return value / base if value is not None and base else None

    def _overhead(self, run: Run) -> Optional[Tuple[float, float]]:
        """(time the steps cost beyond steady steps, steady step time) of a run."""
        step, compile_time, compile_steps = (
            run.summary("steady_step_time_s"),
            run.summary("compile_steps_time_s"),
            run.summary("compile_steps"),
        )
        if step is None or compile_time is None or compile_steps is None:
            return None
        return compile_time - compile_steps * step, step

    def payback_steps(self, run: Run) -> Optional[float]:
        """Training steps after which the run has caught up with the baseline (``inf``: never)."""
        baseline = self.baseline_for(run)
        if baseline is None or not run.ok or run is baseline:
            return None
        mine, base = self._overhead(run), self._overhead(baseline)
        if mine is None or base is None:
            return None
        extra, saved = mine[0] - base[0], base[1] - mine[1]
        if extra <= 0:
            return 0.0 if saved >= 0 else math.inf
        return extra / saved if saved > 0 else math.inf

    def loss_change(self, run: Run) -> Optional[float]:
        """Relative difference of the run's final loss from the baseline's (same kind: validation or training)."""
        baseline = self.baseline_for(run)
        if baseline is None or not run.ok:
            return None
        base = baseline.result
        for key in ("final_val_loss", "final_train_loss"):
            mine, theirs = run.result.get(key), base.get(key)
            if mine is not None and theirs is not None:
                return (mine - theirs) / abs(theirs) if theirs else None
        return None

    # -- checks ---------------------------------------------------------------------------------------

    def check(self) -> None:
        """Flag failed runs, losses off the baseline's, and runs that were not set up like the others."""
        for run in self.runs:
            reference = self.reference_for(run)
            if run.status == "failed":
                error = run.result.get("error") or {}
                run.flags.append(f"failed: {error.get('type')}: {_first_line(error.get('message'))}")
            elif not run.ok:
                run.flags.append("no result file: still running, or killed before it could write one")
            change = self.loss_change(run)
            if change is not None and abs(change) > self.loss_tolerance:
                baseline = self.baseline_for(run)
                run.flags.append(
                    f"final loss {final_loss(run.result):.4f} is {change:+.1%} off {baseline.label}'s "
                    f"{final_loss(baseline.result):.4f} (tolerance {self.loss_tolerance:.0%})"
                )
            if reference is not None and run.result is not None and run is not reference:
                differences = [
                    f"{name} {_show(run.result.get(key))} vs {_show(reference.result.get(key))}"
                    for name, key, finished_only in COMPARED
                    if run.result.get(key) != reference.result.get(key) and (run.ok or not finished_only)
                ]
                if differences:
                    run.flags.append(f"not comparable with {reference.label}: " + "; ".join(differences))
        if self.baseline is None:
            self.notes.append("no eager baseline (a `none` run) finished: no speedups, payback or loss check")

    def reference_for(self, run: Run) -> Optional[Run]:
        """What a run must be set up like: its speedup's baseline (its seed's, else the sweep's), so that repeats
        over seeds are compared seed by seed; without any baseline, the first finished run of its seed."""
        baseline = self.baseline_for(run)
        if baseline is not None:
            return baseline
        same_seed = [other for other in self.runs if other.ok and other.seed == run.seed]
        return next(iter(same_seed), None) or next((other for other in self.runs if other.ok), None)

    def equal_comparison(self) -> str:
        reported = [run for run in self.runs if run.result is not None]
        if not reported:
            return "Equal comparison: no run has a result yet."
        unequal = [run for run in self.runs if any(f.startswith("not comparable") for f in run.flags)]
        reference = (self.baseline or next((r for r in reported if r.ok), reported[0])).result
        seeds = self.seeds
        seed = f"seeds {', '.join(map(str, seeds))}, each run against its seed's" if len(seeds) > 1 else "seed"
        seed += "" if len(seeds) > 1 else f" {reference.get('seed')}"
        described = (
            f"{seed}, {reference.get('steps')} steps, recipe {reference.get('recipe')} "
            f"with the same data (order from the seed) and model settings, precision {reference.get('precision')}, "
            f"{'fresh' if reference.get('fresh_cache') else 'shared'} Inductor cache"
        )
        if unequal:
            return f"Equal comparison: NO, {len(unequal)} run(s) differ (flagged below); the others: {described}."
        return f"Equal comparison: yes, every run with a result: {described}."

    # -- text -----------------------------------------------------------------------------------------

    def environments(self) -> Dict[Tuple[str, str], List[str]]:
        """(device, versions) -> the runs that had them; runs that failed before making a Trainer have none."""
        seen: Dict[Tuple[str, str], List[str]] = {}
        for run in self.runs:
            environment = (run.result or {}).get("environment") or {}
            if environment.get("device"):
                versions = ", ".join(f"{k} {v}" for k, v in (environment.get("versions") or {}).items() if v)
                seen.setdefault((environment["device"]["name"], versions), []).append(run.label)
        return seen

    def environment_lines(self) -> List[str]:
        seen = self.environments()
        if len(seen) <= 1:
            return [f"Device: {device}; {versions}" for device, versions in seen] or ["Device: unknown"]
        return [f"Device: {device}; {versions} (runs: {', '.join(runs)})" for (device, versions), runs in seen.items()]

    def rows(self) -> List[List[str]]:
        rows = []
        for rank, run in enumerate(self.ranked, 1):
            ok = run.ok
            peak = run.summary("peak_memory_bytes")
            loss = final_loss(run.result) if ok else None
            change = self.loss_change(run)
            rows.append(
                [
                    str(rank),
                    run.label,
                    f"failed: {run.result['error']['type']}" if run.status == "failed" else run.status,
                    _fmt(run.summary("compile_time_s") if ok else None, "{:,.1f}"),
                    run.summary("cache_status") or "-",
                    _fmt(cold_compile_time(run.result) if ok else None, "{:,.1f}"),
                    _fmt(objective_value(run.result, "throughput") if ok else None, "{:,.0f}"),
                    _fmt(self.speedup(run), "{:.2f}x"),
                    _steps(self.payback_steps(run)),
                    _fmt(run.summary("recompiles") if ok else None, "{:d}"),
                    _fmt(run.summary("grad_mode_variants") if ok else None, "{:d}"),
                    _fmt(run.summary("graph_breaks") if ok else None, "{:d}"),
                    _fmt(peak / 2**30 if peak is not None else None, "{:.2f}"),
                    _fmt(loss, "{:.4f}"),
                    _fmt(change, "{:+.2%}"),
                ]
            )
        return rows

    def headline(self) -> List[str]:
        counts = {status: sum(run.status == status for run in self.runs) for status in ("ok", "failed", "no result")}
        names = sorted({str(((run.result or {}).get("sweep") or {}).get("name")) for run in self.runs} - {"None"})
        return [
            f"Sweep {', '.join(names) or '-'} in {self.directory}: {len(self.runs)} runs, {counts['ok']} ok, "
            f"{counts['failed']} failed, {counts['no result']} without a result",
            *self.environment_lines(),
            self.equal_comparison(),
            f"Ranked by {self.objective}: {OBJECTIVES[self.objective].description}, "
            f"{'higher' if OBJECTIVES[self.objective].maximize else 'lower'} is better.",
        ]

    def repeat_rows(self) -> List[List[str]]:
        """One row per setting, best median objective first: medians over its finished runs, and their spread."""
        rows = []
        for setting, runs in self._ranked_settings():
            done = [run for run in runs if run.ok]
            throughput = [objective_value(run.result, "throughput") for run in done]
            throughput = [value for value in throughput if value is not None]
            rows.append(
                [
                    setting,
                    f"{len(done)}/{len(runs)}",
                    _fmt(_median([run.summary("compile_time_s") for run in done]), "{:,.1f}"),
                    _fmt(_median(throughput), "{:,.0f}"),
                    f"{min(throughput):,.0f}-{max(throughput):,.0f}" if len(throughput) > 1 else "-",
                    _fmt(_median([self.speedup(run) for run in done]), "{:.2f}x"),
                    str(sum(len(run.flags) > 0 for run in runs)),
                ]
            )
        return rows

    def _median_objective(self, runs: List[Run]) -> Optional[float]:
        values = [objective_value(run.result, self.objective) for run in runs if run.ok and not run.flags]
        return _median(values)

    def _ranked_settings(self) -> List[Tuple[str, List[Run]]]:
        """Settings by their median objective, best first (as ``ranked`` orders runs); none last."""
        maximize = OBJECTIVES[self.objective].maximize

        def key(item: Tuple[str, List[Run]]) -> Tuple[int, float]:
            value = self._median_objective(item[1])
            return (1, 0.0) if value is None else (0, -value if maximize else value)

        return sorted(self.by_setting().items(), key=key)

    def recommendation(self) -> str:
        if self.repeated:
            return self._recommendation_over_seeds()
        return self._recommendation_of_one_run()

    def _recommendation_over_seeds(self) -> str:
        name, runs = self._ranked_settings()[0]
        value = self._median_objective(runs)
        if value is None:
            return "Recommendation: no run finished without a flag; see the flags below."
        counted = sum(run.ok and not run.flags for run in runs)
        text = (
            f"Recommendation: {name} (best median {self.objective} over {counted} seeds: "
            f"{_objective_text(self.objective, value)}"
        )
        speedup = _median([self.speedup(run) for run in runs if run.ok and not run.flags])
        if speedup is not None and all(run.policy != "none" for run in runs):
            text += f"; {speedup:.2f}x its seeds' baselines (median)"
        return text + ")."

    def _recommendation_of_one_run(self) -> str:
        candidates = [
            run
            for run in self.ranked
            if run.ok and not run.flags and objective_value(run.result, self.objective) is not None
        ]
        if not candidates:
            return "Recommendation: no run finished without a flag; see the flags below."
        best = candidates[0]
        value = objective_value(best.result, self.objective)
        text = f"Recommendation: {best.label} (best {self.objective}: {_objective_text(self.objective, value)}"
        speedup, payback = self.speedup(best), self.payback_steps(best)
        if best is self.baseline:
            text += "; no compiled policy beat eager"
        elif speedup is not None:
            text += f"; {speedup:.2f}x the baseline's steady throughput"
            if payback is not None:
                text += (
                    "; never pays off its compile time"
                    if math.isinf(payback)
                    else f"; its compile time pays off after {_steps(payback)} steps"
                )
        passed_over = [
            run.label
            for run in self.ranked[: self.ranked.index(best)]
            if run.ok and objective_value(run.result, self.objective) is not None
        ]
        if passed_over:
            text += f"; ranked higher but flagged: {', '.join(passed_over)}"
        return text + ")."

    def flag_lines(self) -> List[str]:
        return [f"{run.label}: {flag}" for run in self.ranked for flag in run.flags] + self.notes

    def text(self, plot: Optional[Path] = None) -> str:
        table = text_table(COLUMNS, self.rows())
        flags = self.flag_lines()
        parts = [*self.headline(), "", *table, ""]
        if self.repeated:
            parts += ["Over the seeds (medians):", *text_table(REPEAT_COLUMNS, self.repeat_rows()), ""]
        parts.append(self.recommendation())
        if flags:
            parts += ["Flags:", *(f"  - {f}" for f in flags)]
        if plot is not None:
            parts.append(f"Plot: {plot}")
        return "\n".join(parts)

    def markdown(self, plot: Optional[Path] = None) -> str:
        def cells(values) -> str:
            return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

        table = [cells(COLUMNS), cells("---" for _ in COLUMNS), *(cells(r) for r in self.rows())]
        parts = [*(f"- {line}" for line in self.headline()), "", *table, ""]
        if self.repeated:
            repeats = [cells(REPEAT_COLUMNS), cells("---" for _ in REPEAT_COLUMNS)]
            parts += ["Over the seeds (medians):", "", *repeats, *(cells(r) for r in self.repeat_rows()), ""]
        parts.append(self.recommendation())
        flags = self.flag_lines()
        if flags:
            parts += ["", "Flags:", "", *(f"- {f}" for f in flags)]
        if plot is not None:
            parts += ["", f"![compile time against steady throughput]({plot.name})"]
        return "\n".join(parts)

    # -- plot -----------------------------------------------------------------------------------------

    def plot(self, path: Path) -> Path:
        """Compile time against steady throughput, one labelled point per finished run."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
        points = [
            (run, run.summary("compile_time_s"), objective_value(run.result, "throughput"))
            for run in self.runs
            if run.ok
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
        if self.baseline is not None and objective_value(self.baseline.result, "throughput"):
            axes.axhline(
                objective_value(self.baseline.result, "throughput"),
                color="gray",
                linestyle="--",
                linewidth=1,
                label=f"{self.baseline.label} (eager baseline)",
            )
            axes.legend(loc="lower right", fontsize=9)
        failed = [run.label for run in self.runs if not run.ok]
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
        axes.set_ylabel("steady throughput (tokens/s)")
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        axes.margins(x=0.2, y=0.15)
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        device = ", ".join(sorted({device for device, _ in self.environments()})) or "unknown device"
        axes.set_title(f"{self.directory.name}: compile time vs throughput\n{device}", fontsize=10)
        axes.grid(alpha=0.3)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
        plt.close(figure)
        return path


def build_report(
    directory: Path, objective: str = "throughput", loss_tolerance: float = DEFAULT_LOSS_TOLERANCE
) -> Report:
    if objective not in OBJECTIVES:
        raise ReportError(f"unknown objective {objective!r}. Valid objectives: {', '.join(OBJECTIVES)}.")
    if not loss_tolerance >= 0:
        raise ReportError(f"the loss tolerance must be >= 0, got {loss_tolerance}")
    runs = find_runs(directory)
    baselines: Dict[Any, Run] = {}
    for run in runs:
        if run.result is not None and is_baseline(run.result):
            baselines.setdefault(run.seed, run)
    baseline = next(iter(baselines.values()), None)
    report = Report(Path(directory), runs, objective, loss_tolerance, baseline, baselines=baselines)
    report.check()
    return report


def _median(values: List[Optional[float]]) -> Optional[float]:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _first_line(text: Optional[str]) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _show(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fmt(value: Optional[float], pattern: str) -> str:
    if value is None:
        return "-"
    return pattern.format(int(value)) if pattern == "{:d}" else pattern.format(value)


def _steps(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{math.ceil(value):,}"


def _objective_text(name: str, value: float) -> str:
    if name == "throughput":
        return f"{value:,.0f} tokens/s"
    if name == "memory":
        return f"{value / 2**30:.2f} GiB"
    if name == "loss":
        return f"{value:.4f}"
    return f"{value:,.1f} s"
