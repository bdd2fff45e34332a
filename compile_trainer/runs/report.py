"""``compile-trainer report <multirun dir>``: a sweep's runs side by side, ranked, and which policy to use.

Reads the ``result.json`` files that ``train.py`` writes (never W&B's servers). Runs that failed are
listed with their error and runs that left no result (still running, killed) with their overrides:
no run is dropped silently. Speedups, payback and the loss check are against the sweep's eager
baseline: a ``none`` run (nothing compiled, optimizer included). Runs that differ only in ``seed`` are repeats:
each is compared with the baseline and the runs of its own seed, and a table of medians over the seeds (with
their spread) ranks the settings; the recommendation then comes from it. Needs neither Hydra nor W&B.

The runs are read by ``runs.sweep_runs``; the report is written as text or Markdown by ``runs.report_tables``,
its plot by ``runs.report_plot``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from compile_trainer.runs.results import OBJECTIVES, final_loss, objective_value
from compile_trainer.runs.sweep_runs import ReportError, Run, cold_compile_time, find_runs, is_baseline

# The report, and what callers import with it from here (defined in sweep_runs).
__all__ = [
    "COMPARED",
    "DEFAULT_LOSS_TOLERANCE",
    "PLOT_FILE",
    "Report",
    "ReportError",
    "Run",
    "build_report",
    "cold_compile_time",
    "find_runs",
    "is_baseline",
    "median",
    "steps_text",
]

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

    @property
    def throughput_unit(self) -> str:
        """What the runs' steady throughput counts (their telemetry's ``items_unit``: tokens, images, samples or
        items of the user's own); ``items`` where runs count different things."""
        units = {((run.result or {}).get("summary") or {}).get("items_unit") or "tokens" for run in self.runs}
        return units.pop() if len(units) == 1 else "items"

    def environments(self) -> Dict[Tuple[str, str], List[str]]:
        """(device, versions) -> the runs that had them; runs that failed before making a Trainer have none."""
        seen: Dict[Tuple[str, str], List[str]] = {}
        for run in self.runs:
            environment = (run.result or {}).get("environment") or {}
            if environment.get("device"):
                versions = ", ".join(f"{k} {v}" for k, v in (environment.get("versions") or {}).items() if v)
                seen.setdefault((environment["device"]["name"], versions), []).append(run.label)
        return seen

    # -- recommendation -------------------------------------------------------------------------------

    def _median_objective(self, runs: List[Run]) -> Optional[float]:
        values = [objective_value(run.result, self.objective) for run in runs if run.ok and not run.flags]
        return median(values)

    def ranked_settings(self) -> List[Tuple[str, List[Run]]]:
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
        name, runs = self.ranked_settings()[0]
        value = self._median_objective(runs)
        if value is None:
            return "Recommendation: no run finished without a flag; see the flags below."
        counted = sum(run.ok and not run.flags for run in runs)
        text = (
            f"Recommendation: {name} (best median {self.objective} over {counted} seeds: "
            f"{_objective_text(self.objective, value, self.throughput_unit)}"
        )
        speedup = median([self.speedup(run) for run in runs if run.ok and not run.flags])
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
        shown = _objective_text(self.objective, value, self.throughput_unit)
        text = f"Recommendation: {best.label} (best {self.objective}: {shown}"
        speedup, payback = self.speedup(best), self.payback_steps(best)
        if best is self.baseline:
            text += "; no compiled policy beat eager"
        elif speedup is not None:
            text += f"; {speedup:.2f}x the baseline's steady throughput"
            if payback is not None:
                text += (
                    "; never pays off its compile time"
                    if math.isinf(payback)
                    else f"; its compile time pays off after {steps_text(payback)} steps"
                )
        passed_over = [
            run.label
            for run in self.ranked[: self.ranked.index(best)]
            if run.ok and objective_value(run.result, self.objective) is not None
        ]
        if passed_over:
            text += f"; ranked higher but flagged: {', '.join(passed_over)}"
        return text + ")."


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


def median(values: List[Optional[float]]) -> Optional[float]:
    """The median of the values there are; ``None`` without any."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _first_line(text: Optional[str]) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _show(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def steps_text(value: Optional[float]) -> str:
    """A payback in steps as the report writes it: rounded up, ``never``, or ``-`` where unknown."""
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{math.ceil(value):,}"


def _objective_text(name: str, value: float, unit: str) -> str:
    if name == "throughput":
        return f"{value:,.0f} {unit}/s"
    if name == "memory":
        return f"{value / 2**30:.2f} GiB"
    if name == "loss":
        return f"{value:.4f}"
    return f"{value:,.1f} s"
