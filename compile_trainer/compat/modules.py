"""A module's calls: the compiled call ``module.compile()`` installs, the call without it, compile regions."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .entry import Entry

__all__ = [
    "ENTRIES",
    "call_uncompiled",
    "compiled_call",
    "install_compiled_call",
    "is_nested_compile_region",
    "user_compiled",
]

# nn.Module.compile() sets module._compiled_call_impl, which Module.__call__ runs instead of _call_impl;
# state_dict keys stay as they are.


def install_compiled_call(module: nn.Module, call: Optional[Callable[..., Any]]) -> None:
    """Make ``module(...)`` run ``call`` (``None``: its own forward again)."""
    module._compiled_call_impl = call


def compiled_call(module: nn.Module) -> Optional[Callable[..., Any]]:
    return module.__dict__.get("_compiled_call_impl")


def call_uncompiled(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(...)`` with its hooks, without the compiled call installed on it."""
    return module._call_impl(*args, **kwargs)


def user_compiled(module: nn.Module) -> Optional[str]:
    """How the user compiled ``module`` already (``module.compile()`` / ``torch.compile(module)``), or None."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return "torch.compile(module)"
    if compiled_call(module) is not None:
        return "module.compile()"
    return None


def is_nested_compile_region(function: Callable[..., Any]) -> bool:
    """Whether ``nested_compile_region`` marked ``function`` already (it sets ``__marked_compile_region_fn__``)."""
    return hasattr(function, "__marked_compile_region_fn__")


# -- The probes --------------------------------------------------------------------------------------------


def _probe_compiled_call() -> None:
    module = nn.Linear(2, 2)
    install_compiled_call(module, lambda x: x * 0)
    assert compiled_call(module) is not None
    assert torch.equal(module(torch.ones(1, 2)), torch.zeros(1, 2)), "Module.__call__ ignores _compiled_call_impl"
    assert user_compiled(module) == "module.compile()"
    assert call_uncompiled(module, torch.ones(1, 2)).shape == (1, 2)
    install_compiled_call(module, None)
    assert compiled_call(module) is None
    assert user_compiled(module) is None and user_compiled(torch.compile(module)) == "torch.compile(module)"


def _probe_nested_compile_region() -> None:
    assert hasattr(torch.compiler, "nested_compile_region")

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert not is_nested_compile_region(forward)
    assert is_nested_compile_region(torch.compiler.nested_compile_region(forward))


ENTRIES = [
    Entry(
        "compiled_call",
        _probe_compiled_call,
        reaches=(
            "torch.nn.Module._compiled_call_impl",
            "torch.nn.Module._call_impl",
            "torch._dynamo.eval_frame.OptimizedModule",
        ),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "nested_compile_region",
        _probe_nested_compile_region,
        reaches=("torch.compiler.nested_compile_region",),
        checked=("2.9.1", "2.13"),
    ),
]
