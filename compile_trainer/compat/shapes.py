"""Dynamo's shapes: its marks on a tensor (dynamic dimensions, static addresses), and floats as symbolic inputs."""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from .entry import CountingBackend, Entry, double, fresh, renamed_function

__all__ = [
    "ENTRIES",
    "copy_dynamo_marks",
    "float_source",
    "guard_code_parts",
    "mark_dynamic",
    "mark_static_address",
    "maybe_mark_dynamic",
    "prime_dynamic_floats",
]

# mark_dynamic and friends live in torch._dynamo (documented, but under a private package; 2.0+).


def mark_dynamic(tensor: torch.Tensor, dim: Any, min: Optional[int] = None, max: Optional[int] = None) -> None:
    torch._dynamo.mark_dynamic(tensor, dim, min=min, max=max)


def maybe_mark_dynamic(tensor: torch.Tensor, dims: Any) -> None:
    torch._dynamo.maybe_mark_dynamic(tensor, dims)


def mark_static_address(tensor: torch.Tensor) -> None:
    """A tensor whose storage stays put: CUDA graphs need not copy it, and no guard is added on its address."""
    torch._dynamo.mark_static_address(tensor, guard=False)


# The marks are attributes of the tensor object, named ``_dynamo_*`` (``_dynamo_dynamic_indices``,
# ``_dynamo_static_input_type``...): a copy of a tensor keeps them only if they are copied.
_DYNAMO_MARK_PREFIX = "_dynamo"


def copy_dynamo_marks(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` with each of Dynamo's shape marks that ``source`` carries (a shallow copy of each)."""
    for name, mark in vars(source).items():
        if name.startswith(_DYNAMO_MARK_PREFIX):
            setattr(target, name, copy.copy(mark))
    return target


# Per-block floats as graph inputs: Dynamo wraps a float it reads as a symbolic input only once it has seen two
# values of it (automatic dynamic): the first compile specializes, the second recompiles. Blocks sharing one entry
# differ in such a value by design, so their entry's state is primed as after a second value (torch._dynamo.pgo,
# 2.6-2.13: the code state per code object, keyed by the source's name). torch._dynamo.reset() clears it.


def float_source(argument: str, path: str) -> str:
    """Dynamo's name for the float ``path`` (``"drop_path.drop_prob"``) of the module passed as ``argument``."""
    *modules, attribute = path.split(".")
    return f"L[{argument!r}]" + "".join(f"._modules[{m!r}]" for m in modules) + f".{attribute}"


def prime_dynamic_floats(code: Any, sources: Sequence[str]) -> None:
    """Dynamo's first compile of ``code`` takes these float sources as symbolic graph inputs."""
    from torch._dynamo import pgo

    state = pgo.get_code_state()[pgo.CodeId.make(code)]
    for source in sources:
        state.automatic_dynamic[source] = pgo.FrameStateSizeEntry(scalar=pgo.auto_dynamic)


def guard_code_parts(guard: Any) -> List[str]:
    """The Python expressions a guard given to a ``guard_filter_fn`` checks (a shape-env guard's relations)."""
    return list(getattr(guard.orig_guard, "code_list", None) or [])


# -- The probes --------------------------------------------------------------------------------------------


def _probe_mark_dynamic() -> None:
    """A marked dimension compiles one graph for every size in range; the marks travel with a tensor's copy."""
    for mark in (lambda t: mark_dynamic(t, 1, min=2, max=8), lambda t: maybe_mark_dynamic(t, [1])):
        backend = CountingBackend()
        compiled = torch.compile(fresh(double), backend=backend)
        for length in (3, 4, 5):
            marked = torch.zeros(2, length)
            mark(marked)
            compiled(copy_dynamo_marks(marked, torch.zeros(2, length)))
        assert backend.graphs == 1, f"{backend.graphs} graphs for 3 lengths of a dynamic dimension"


def _probe_mark_static_address() -> None:
    tensor = torch.zeros(2)
    mark_static_address(tensor)
    assert getattr(tensor, "_dynamo_static_input_type", None) == "unguarded"
    assert getattr(copy_dynamo_marks(tensor, torch.zeros(2)), "_dynamo_static_input_type", None) == "unguarded"


def _probe_dynamic_floats() -> None:
    """Two modules that differ in a float share one graph when the entry is primed."""
    from torch._dynamo.testing import CompileCounter

    def entry(module, x):
        return x * module.scale

    counter, seen = CompileCounter(), []
    function = renamed_function(entry, "compat_probe_floats")
    code = function.__code__
    prime_dynamic_floats(code, [float_source("module", "scale")])
    for scale in (0.5, 0.25):
        module = nn.Module()
        module.scale = scale

        def watch(guards):
            seen.extend(part for guard in guards for part in guard_code_parts(guard))
            return [True] * len(guards)

        compiled = torch.compile(function, backend=counter, options={"guard_filter_fn": watch})
        assert torch.equal(compiled(module, torch.ones(2)), torch.full((2,), scale))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two values of a primed float"
    assert any("L['module'].scale" in part for part in seen), seen


ENTRIES = [
    Entry(
        "mark_dynamic",
        _probe_mark_dynamic,
        reaches=("torch._dynamo.mark_dynamic", "torch._dynamo.maybe_mark_dynamic"),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "mark_static_address",
        _probe_mark_static_address,
        reaches=("torch._dynamo.mark_static_address",),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "prime_dynamic_floats",
        _probe_dynamic_floats,
        reaches=(
            "torch._dynamo.pgo.get_code_state",
            "torch._dynamo.pgo.CodeId",
            "torch._dynamo.pgo.FrameStateSizeEntry",
            "torch._dynamo.pgo.auto_dynamic",
        ),
        checked=("2.9.1", "2.13"),
    ),
]
