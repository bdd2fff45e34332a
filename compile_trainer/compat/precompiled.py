"""Precompiled functions: Dynamo's trace and the backend's code, compiled without running, serialized and loaded.

``torch.compile(fn, fullgraph=True).aot_compile(((args), kwargs))`` returns an ``AOTCompiledFunction``:
``guard_check(*args, **kwargs)``, ``.fn(*args, **kwargs)`` runs the compiled code;
``type(f).serialize(f).serialized_data`` and ``AOTCompiledFunction.deserialize(data, f_globals=...)`` move it between
processes. Behind ``torch._dynamo.config.enable_aot_compile``. The guards are rebuilt at load from the grad mode and
autocast state of that moment; guards on globals are left out."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .backends import inductor_mode_options
from .entry import Entry, Obsolete, double, fresh, needs_torch

__all__ = [
    "ENTRIES",
    "aot_changed_sources",
    "aot_compile",
    "aot_compile_problem",
    "load_aot_compiled",
    "serialize_aot_compiled",
]

_AOT_COMPILE_VERSION = (2, 11)


def aot_compile_problem() -> Optional[str]:
    """Why this torch cannot serialize a compiled region (None when it can)."""
    problem = needs_torch("the precompiled cache layer (torch.compile(...).aot_compile)", _AOT_COMPILE_VERSION)
    if problem is None and not hasattr(torch._dynamo, "aot_compile"):
        problem = f"the precompiled cache layer: torch {torch.__version__} has no torch._dynamo.aot_compile"
    return problem


def _serializable_guards(guards: Sequence[Any]) -> List[bool]:
    """The guards ``aot_compile`` can save: its default filter's (no guard on a global, none of a type the
    serializer refuses), also leaving out guards refused for a *derived* type, which the default keeps and the
    serializer then fails on ("ID_MATCH guard cannot be serialized", torch 2.11-2.13: a CONSTANT_MATCH on the
    ``__code__`` in a closure, as in Hugging Face's decorated ``forward`` methods). What those guards pin (the
    model's classes and code) the bundle checks itself: its key has the model's structure, and an artifact whose
    traced sources changed is never served."""
    from torch._dynamo.guards import CheckFunctionManager

    refused = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (guard.is_global or guard.guard_type in refused or refused.intersection(guard.derived_guard_types))
        for guard in guards
    ]


def aot_compile(
    function: Callable[..., Any], compile_kwargs: Dict[str, Any], args: tuple, kwargs: Dict[str, Any]
) -> Any:
    """``function`` traced whole for these inputs (no graph break allowed) and compiled, without running it."""
    compile_kwargs = {**compile_kwargs, "fullgraph": True}
    # the guard filter travels in ``options``, which torch.compile takes beside no ``mode``: the mode as its options
    mode, options = compile_kwargs.pop("mode", None), dict(compile_kwargs.pop("options", None) or {})
    if mode and mode != "default":
        options = {**inductor_mode_options(mode), **options}
    compile_kwargs["options"] = {**options, "guard_filter_fn": _serializable_guards}
    patch = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(**patch), warnings.catch_warnings():
        # building the guards reads .grad of non-leaf inputs (a block's activations), which warns on 2.13
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        return torch.compile(function, **compile_kwargs).aot_compile((args, kwargs))


def serialize_aot_compiled(compiled: Any) -> bytes:
    return type(compiled).serialize(compiled).serialized_data


def load_aot_compiled(data: bytes, f_globals: Dict[str, Any], cudagraphs: bool = False) -> Any:
    """The function ``serialize_aot_compiled`` wrote; its guards check the grad mode and autocast state of now.

    ``cudagraphs``: whether its Inductor graphs run as CUDA graphs. Loading does not take that from the options it
    was compiled with but from the process's Inductor config of the moment (``deserialize_bundled_cache_entry``,
    torch 2.11-2.14: "in precompile, we never actually call compile_fx"), so a region compiled under
    ``reduce-overhead`` loaded without CUDA graphs: on 2 x H200 its steps took 28-30 ms against 23 ms compiled.
    """
    from torch._dynamo.aot_compile import AOTCompiledFunction

    with torch._inductor.config.patch({"triton.cudagraphs": cudagraphs}):
        return AOTCompiledFunction.deserialize(data, f_globals=f_globals)


def aot_changed_sources(compiled: Any, skip: Callable[[str], bool]) -> List[str]:
    """Modules (not ``skip``-ped) whose source lines that Dynamo traced differ from the ones compiled."""
    import hashlib
    import importlib
    import inspect

    changed = []
    for source in compiled.source_info().inlined_sources:
        if skip(source.module):
            continue
        try:
            lines = inspect.getsourcelines(importlib.import_module(source.module))[0]
            text = "".join(lines[source.firstlineno - 1 : source.lastlineno - 1])
        except (ImportError, OSError, TypeError):
            text = None
        if text is None or hashlib.sha256(text.encode()).hexdigest() != source.checksum:
            changed.append(f"{source.module} (lines {source.firstlineno}-{source.lastlineno})")
    return sorted(changed)


# -- The probes --------------------------------------------------------------------------------------------


def _probe_aot_compile() -> None:
    import inspect

    from torch._functorch._aot_autograd import aot_autograd_result

    assert aot_compile_problem() is None
    function = fresh(double)
    compiled = aot_compile(function, {"backend": "eager"}, (torch.ones(2),), {})
    assert compiled.guard_check(torch.ones(2)) and not compiled.guard_check(torch.ones(3))
    assert torch.equal(compiled.fn(torch.ones(2)), torch.full((2,), 2.0))
    assert aot_changed_sources(compiled, lambda name: False) == []
    loaded = load_aot_compiled(serialize_aot_compiled(compiled), f_globals=function.__globals__)
    assert loaded.guard_check(torch.ones(2)) and torch.equal(loaded.fn(torch.ones(2)), torch.full((2,), 2.0))
    # what load_aot_compiled patches: loading reads CUDA graphs from the Inductor config of the moment
    assert "config.triton.cudagraphs" in inspect.getsource(aot_autograd_result.deserialize_bundled_cache_entry)


ENTRIES = [
    Entry(
        "aot_compile",
        _probe_aot_compile,
        reaches=(
            "torch._dynamo.aot_compile.AOTCompiledFunction",
            "torch._dynamo.config.enable_aot_compile",
            "torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES",
            "torch._functorch._aot_autograd.aot_autograd_result.deserialize_bundled_cache_entry",
        ),
        checked=("2.11 H100", "2.13"),
        upstream=(
            "https://github.com/pytorch/pytorch/pull/195346",
            "https://github.com/pytorch/pytorch/issues/155703",
            "https://github.com/pytorch/pytorch/pull/195158",
        ),
        present_from=_AOT_COMPILE_VERSION,
        obsolete=(
            Obsolete(_AOT_COMPILE_VERSION, "aot_compile_problem's torch version check and this entry's present_from"),
        ),
    ),
]
