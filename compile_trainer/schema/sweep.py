"""The ``sweep`` node: how the runs of a multirun are grouped, scored and compiled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

# What a run can be scored by; each is read from a run's result by ``compile_trainer.runs.results.OBJECTIVES``.
OBJECTIVE_NAMES = ("throughput", "compile_time", "train_time", "memory", "loss")


@dataclass
class SweepSettings:
    """How the runs of a multirun are grouped, scored and compiled (the ``sweep`` node of the config)."""

    # The W&B group of a multirun's runs and the report's name for it; default: the sweep directory's name.
    name: Optional[str] = None
    # What each run returns to Hydra's sweeper (Optuna), and the default ranking of `compile-trainer report`.
    objective: str = "throughput"
    # A run that compiles for longer than this scores the objective's worst value (-inf when maximizing).
    compile_time_budget_s: Optional[float] = None
    # Compile each run with empty Inductor and Triton caches (torch._inductor.utils.fresh_cache): cold
    # compile times for every policy, whatever ran before.
    fresh_cache: bool = False


def sweep_settings_problems(settings: SweepSettings) -> List[str]:
    problems = []
    if settings.objective not in OBJECTIVE_NAMES:
        problems.append(
            f"sweep.objective={settings.objective!r} is unknown. Valid objectives: {', '.join(OBJECTIVE_NAMES)}"
        )
    if settings.compile_time_budget_s is not None and not settings.compile_time_budget_s > 0:
        problems.append(f"sweep.compile_time_budget_s must be positive, got {settings.compile_time_budget_s}")
    return problems
