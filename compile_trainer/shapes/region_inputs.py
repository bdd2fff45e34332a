"""Interceptors of compiled regions' calls for the ``shapes`` section (``compile_trainer.compiling.region_call``).

``MarkRegionInputs``: regional compilation sees activations, not the batch, so an input of a compiled region
is marked dynamic where it has the batch's dynamic sizes at the same dimensions. ``StrictRecompiles``: once
armed for a mode (training / evaluation), a region runs under ``torch.compiler.set_stance("fail_on_recompile")``
and a recompile raises ``RecompileError`` naming the region, its shapes and the guard. The stance is set only
around region calls, so other compiled code (a compiled optimizer step, say) can still compile.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Set, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from compile_trainer import compat
from compile_trainer.compiling.region_call import MARK_INPUTS, STRICT_RECOMPILES
from compile_trainer.compiling.regions import AppliedPolicy, CompiledRegion
from compile_trainer.shapes.batch import BatchShaper


class RecompileError(RuntimeError):
    """A compiled region would recompile after warm-up while ``strict_recompiles`` is on."""


def step_mode(root: nn.Module) -> Tuple[bool, bool]:
    """What a compiled graph depends on beyond its inputs: grad mode and train/eval mode."""
    return torch.is_grad_enabled(), root.training


def mode_name(mode: Tuple[bool, bool]) -> str:
    return "training" if mode[1] else "evaluation"


class MarkRegionInputs:
    """Marks each region's tensor inputs dynamic where they carry the last batch's dynamic sizes."""

    position = MARK_INPUTS
    replaces_compiled = False

    def __init__(self, shaper: BatchShaper):
        self.shaper = shaper

    def __call__(self, item: CompiledRegion, proceed: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        self.shaper.mark_region_inputs(args, kwargs, item.entry_name)
        return proceed(*args, **kwargs)


class StrictRecompiles:
    """After ``arm(mode)``, a region that would recompile in that mode raises ``RecompileError``."""

    position = STRICT_RECOMPILES
    replaces_compiled = False

    def __init__(self, applied: AppliedPolicy):
        self.applied = applied
        self.armed: Set[Tuple[bool, bool]] = set()

    def arm(self, mode: Tuple[bool, bool]) -> None:
        """From now on a recompile in this mode is an error."""
        self.armed.add(mode)

    def __call__(self, item: CompiledRegion, proceed: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        mode = step_mode(self.applied.root)
        if mode not in self.armed:
            return proceed(*args, **kwargs)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return proceed(*args, **kwargs)
        except RuntimeError as error:
            if not compat.is_fail_on_recompile(error):
                raise
            raise RecompileError(self._describe(item, mode, error, (args, kwargs))) from error

    def _describe(self, item: CompiledRegion, mode: Tuple[bool, bool], error: RuntimeError, inputs: Any) -> str:
        sharing = [c.region.name for c in self.applied.compiled if c.entry_name == item.entry_name]
        shared = f" (its graph is shared by {', '.join(sharing)})" if len(sharing) > 1 else ""
        shapes = ", ".join(str(tuple(t.shape)) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
        return (
            f"strict_recompiles: compiled region {item.region.name!r} ({item.region.class_name}){shared} would "
            f"recompile in {mode_name(mode)} after warm-up, called with tensors of shape {shapes}. "
            f"Dynamo says: {error}\n"
            "Declare this shape in the compile policy (a bucket in shapes.pad, a dimension in shapes.dynamic), "
            "or turn shapes.strict_recompiles off."
        )


class RegionShapeInterceptors:
    """The shape interceptors a ``ShapesPolicy`` asks for, added to an applied policy's chain; ``remove()``."""

    def __init__(self, applied: AppliedPolicy, shaper: BatchShaper):
        self.applied = applied
        shapes = shaper.shapes
        self.strict = StrictRecompiles(applied) if shapes.strict_recompiles else None
        marks = MarkRegionInputs(shaper) if shapes.mark_region_inputs and shapes.dynamic else None
        self.added = [i for i in (marks, self.strict) if i is not None]
        for interceptor in self.added:
            applied.interceptors.add(interceptor)

    def arm(self, mode: Tuple[bool, bool]) -> None:
        if self.strict is not None:
            self.strict.arm(mode)

    def remove(self) -> None:
        for interceptor in self.added:
            self.applied.interceptors.remove(interceptor)
        self.added = []
