"""An entry of the door: its record (``Entry``, ``Obsolete``), the torch version helpers, and what the probes share."""

from __future__ import annotations

import itertools
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["Entry", "Obsolete", "needs_torch", "renamed_function", "torch_version"]


def torch_version() -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def needs_torch(feature: str, version: tuple) -> Optional[str]:
    """``None`` when the installed torch is at least ``version``; else a sentence saying what ``feature`` needs."""
    if torch_version() >= version:
        return None
    return f"{feature} needs torch >= {'.'.join(map(str, version))}; this is torch {torch.__version__}"


def renamed_function(function: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``function`` (defaults and closure kept) with a code object of its own named ``name``: Dynamo
    caches compiled code per code object, and its metrics report the code's name. Public Python, kept here, at
    the bottom of the package, so that every layer and the probes share the one copy."""
    code = function.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


@dataclass(frozen=True)
class Obsolete:
    """Code kept only for torch versions before ``torch``: once the oldest supported torch (pyproject.toml's
    ``torch>=X.Y``) reaches it, ``what`` goes (tests/test_compat.py fails until it has)."""

    torch: Tuple[int, int]
    what: str


@dataclass(frozen=True)
class Entry:
    """One door to torch's internals, as data beside its probe.

    ``reaches``: torch's qualified names of what it uses, the first one present on every torch the entry is probed
    on. ``checked``: the torch versions it was read and run on (``"2.13"``: on the CPU; ``"2.11 H100"``: on that
    GPU). ``upstream``: the torch issues and PRs about it. ``present_from``: probed only from that torch (before,
    its probe must fail). ``obsolete``: code the entry keeps for older torch versions, and from when it can go."""

    name: str
    probe: Callable[[], None]  # raises when the entry is gone or changed shape; returns None
    reaches: Tuple[str, ...]
    checked: Tuple[str, ...]
    upstream: Tuple[str, ...] = ()
    present_from: Optional[Tuple[int, int]] = None
    obsolete: Tuple[Obsolete, ...] = ()


# -- What the probes share ---------------------------------------------------------------------------------
# Each probe uses its entry as the library does and asserts what the library relies on (names, fields, texts,
# effects); it returns nothing. Compiles use the eager backend, each on a fresh code object.

_fresh_names = itertools.count()


def fresh(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``function`` with a code object of its own: Dynamo compiles it anew, whatever ran before."""
    return renamed_function(function, f"compat_probe_{next(_fresh_names)}_{function.__name__}")


class CountingBackend:
    """A backend that counts the graphs Dynamo hands it and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: Any, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return graph.forward


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def double_with_break(x: torch.Tensor) -> torch.Tensor:
    x = x * 2
    torch._dynamo.graph_break()
    return x + 1
