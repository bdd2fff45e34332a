"""Dynamo's backends: their registry, the object ``torch.compile`` builds for Inductor, Inductor's mode options."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .entry import Entry, double, fresh

__all__ = [
    "ENTRIES",
    "inductor_backend",
    "inductor_mode_options",
    "inductor_options_without_size_guards",
    "list_backends",
    "lookup_backend",
]


def list_backends() -> List[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def lookup_backend(name: str) -> Callable[..., Any]:
    return torch._dynamo.lookup_backend(name)


def inductor_backend(mode: Optional[str], options: Optional[Dict[str, Any]], dynamic: Optional[bool]) -> Any:
    """The backend object ``torch.compile(backend="inductor", mode=..., options=...)`` builds."""
    return torch._TorchCompileInductorWrapper(mode, options, dynamic)


def inductor_mode_options(mode: str) -> Dict[str, Any]:
    return torch._inductor.list_mode_options(mode)


def inductor_options_without_size_guards() -> Dict[str, Any]:
    """Inductor options under which Inductor guards on no dynamic size of its own.

    The mix-order reduction (torch >= 2.10; fuses a norm's backward reductions) decides with
    ``evaluate_expr(nrow * ncol >= 5 * 2**20)``, a guard on the symbolic length: a stream of lengths crossing that
    size compiled a second graph (``6144*idx.size()[1] >= 5242880``, H100, torch 2.11). Its non-strict mode
    skips the size checks and fuses whatever the size.
    """
    triton_config = torch._inductor.config.triton
    if hasattr(triton_config, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


# -- The probes --------------------------------------------------------------------------------------------


def _probe_backends() -> None:
    assert {"inductor", "eager", "aot_eager"} <= set(list_backends())
    backend = lookup_backend("eager")
    assert torch.equal(torch.compile(fresh(double), backend=backend)(torch.ones(2)), torch.full((2,), 2.0))


def _probe_inductor_backend() -> None:
    """The object torch.compile builds for Inductor: the mode's and the given options applied, and equal settings
    equal (Dynamo reuses a cache entry only under an equal backend). Not compiled: 10-40 s on a CPU."""
    backend = inductor_backend("max-autotune-no-cudagraphs", {"epilogue_fusion": False}, None)
    assert callable(backend) and backend.config.get("max_autotune") is True, backend.config
    assert backend.config.get("epilogue_fusion") is False
    assert backend == inductor_backend("max-autotune-no-cudagraphs", {"epilogue_fusion": False}, None)
    assert inductor_mode_options("max-autotune").get("max_autotune") is True
    assert inductor_mode_options("reduce-overhead").get("triton.cudagraphs") is True


def _probe_inductor_options() -> None:
    """Every option returned is one Inductor's config takes (a renamed one fails when the patch is entered)."""
    options = inductor_options_without_size_guards()
    assert isinstance(options, dict)
    with torch._inductor.config.patch(options):
        for name, value in options.items():
            owner = torch._inductor.config
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            assert getattr(owner, name.split(".")[-1]) == value, name


ENTRIES = [
    Entry(
        "backends",
        _probe_backends,
        reaches=("torch._dynamo.list_backends", "torch._dynamo.lookup_backend"),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "inductor_backend",
        _probe_inductor_backend,
        reaches=("torch._TorchCompileInductorWrapper", "torch._inductor.list_mode_options"),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "inductor_options_without_size_guards",
        _probe_inductor_options,
        reaches=("torch._inductor.config.triton", "torch._inductor.config.triton.mix_order_reduction_non_strict_mode"),
        checked=("2.11 H100", "2.13"),
        upstream=("https://github.com/pytorch/pytorch/pull/171941",),
    ),
]
