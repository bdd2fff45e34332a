"""Eager reference steps: the first training steps run every compiled region's original code, to time eager training.

Whether compiling paid off is a comparison with eager training measured in the same fit, on the same model, data
and device. The first ``steps`` training steps (``telemetry.eager_reference_steps``) are those eager steps: each
region's call runs the module's own ``forward`` (``compat.call_uncompiled``, hooks included) instead of anything
else in its interceptor chain; from the next step on, the compiled code takes over and compiles at its first call,
as it would have at the first step. No step is added: ``training_step`` runs exactly as often as Lightning runs it,
and the results are eager training's (compiled code computes the same).

The steps of a background compile (``background: true``) before its install run eagerly too, but beside a thread
that holds the interpreter while it traces (a step of seconds where alone it takes tens of milliseconds): no
reference. So the reference steps come first, before anything is recorded for the thread, which starts one step
after them. Evaluation between them (a validation loop) runs as the policy says. A fit shorter than
``FIT_STEPS_PER_REFERENCE_STEP`` times ``steps`` (by ``max_steps``) runs none.

Without Lightning::

    reference = EagerReferenceSteps(applied, steps=5)
    for batch in loader:
        eager = reference.begin_step()  # before applied.begin_step()
        applied.begin_step()
        train_step(batch)
        reference.end_step()
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from compile_trainer import compat
from compile_trainer.compiling.region_call import EAGER_REFERENCE
from compile_trainer.compiling.regions import AppliedPolicy, CompiledRegion

# A shorter fit runs no reference steps (a smoke run, a cold-start measurement): they would be over a quarter of it.
FIT_STEPS_PER_REFERENCE_STEP = 4


class EagerReferenceSteps:
    """Interceptor (``region_call.EAGER_REFERENCE``, outermost): during the first ``steps`` training steps, every
    region's call runs its module's original code; it leaves the chain after the last of them."""

    position = EAGER_REFERENCE

    def __init__(self, applied: AppliedPolicy, steps: int):
        self.applied = applied
        self.steps = steps
        self.begun = 0  # training steps begun under it
        self.in_step = False  # a reference step is under way
        applied.interceptors.add(self)

    @property
    def replaces_compiled(self) -> bool:
        """Only while a reference step runs: an evaluation between them runs the compiled code, with its step marks."""
        return self.in_step

    def begin_step(self) -> bool:
        """Call at each training step's start, before ``applied.begin_step()``: whether this step runs eagerly."""
        self.in_step = self.begun < self.steps
        self.begun += self.in_step
        return self.in_step

    def end_step(self) -> None:
        """Call at each training step's end; after the last reference step, the interceptor leaves the chain."""
        self.in_step = False
        if self.begun >= self.steps:
            self.applied.interceptors.remove(self)

    def __call__(self, item: CompiledRegion, proceed: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        if not self.in_step:
            return proceed(*args, **kwargs)
        return compat.call_uncompiled(item.region.module, *args, **kwargs)

    def describe(self) -> str:
        return (
            f"the first {self.steps} training steps run eagerly, timed as the eager reference of the summary's speedup "
            "(telemetry.eager_reference_steps; 0 turns it off); the compiled code takes over after them"
        )


def eager_reference_for(applied: AppliedPolicy, steps: int, fit_steps: Optional[int]) -> Optional[EagerReferenceSteps]:
    """Reference steps for ``applied``, where it compiles any region, ``steps`` is not 0 and the fit is known to be
    long enough (``fit_steps``: its length, None where unknown, as in a fit by epochs): at least
    ``FIT_STEPS_PER_REFERENCE_STEP`` times ``steps``."""
    short = fit_steps is not None and fit_steps < FIT_STEPS_PER_REFERENCE_STEP * steps
    return EagerReferenceSteps(applied, steps) if steps and applied.compiled and not short else None
