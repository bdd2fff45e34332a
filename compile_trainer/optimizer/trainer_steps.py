"""A trainer's optimizers: a compiled step for each, the trainer's own clipping taken over by those steps, their
lines in the plan printed at fit start."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from compile_trainer.optimizer.algorithms import algorithm_for
from compile_trainer.optimizer.auto import OptimizerChoice
from compile_trainer.optimizer.compiled_step import CompiledOptimizerStep, compile_optimizer
from compile_trainer.schema import OptimizerPolicy, PolicyError


def compile_optimizers(
    optimizers: Sequence[torch.optim.Optimizer],
    policy: OptimizerPolicy,
    backend: str = "inductor",
    on_choice: Optional[Callable[[OptimizerChoice], None]] = None,
) -> List[CompiledOptimizerStep]:
    """``compile_optimizer`` for each optimizer; every one is checked before any is changed."""
    if policy.compile != "false":
        for optimizer in optimizers:
            algorithm_for(optimizer)
    steps = [compile_optimizer(optimizer, policy, backend, on_choice) for optimizer in optimizers]
    return [step for step in steps if step is not None]


def take_over_clipping(steps: Sequence[CompiledOptimizerStep], max_value: float, algorithm: str = "norm") -> None:
    """Clip inside each step as a trainer-level setting asks (Lightning's ``gradient_clip_val`` and
    ``gradient_clip_algorithm``: ``norm`` or ``value``); the caller then turns the trainer's own clipping off."""
    if algorithm not in ("norm", "value"):
        raise PolicyError(f"gradient clipping algorithm {algorithm!r}: valid algorithms are norm, value.")
    wanted = (float(max_value), None) if algorithm == "norm" else (None, float(max_value))
    for step in steps:
        if step.clip not in ((None, None), wanted):
            raise PolicyError(
                f"optimizer {type(step.optimizer).__name__}: the policy's optimizer section clips by {step.clipping} "
                f"and the trainer asks to clip by {algorithm} {max_value:g}; set one of them."
            )
        step.set_clipping(*wanted)


def describe_steps(steps: Sequence[CompiledOptimizerStep]) -> str:
    """One line per compiled optimizer step, for the plan printed at fit start."""
    lines = []
    for step in steps:
        params = sum(len(g["params"]) for g in step.optimizer.param_groups)
        mode = "auto: timing " + ", ".join(step.policy.auto_candidates) if step.in_auto_trial else "compiled"
        lines.append(
            f"optimizer {type(step.optimizer).__name__}: {mode} ({params} params in "
            f"{len(step.layout.segments)} flat segments; clipping {step.clipping}; {step.update.describe()})"
        )
        lines += [f"note: {note}" for note in step.notes]
    return "\n".join(lines)
