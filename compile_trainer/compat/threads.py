"""What a compile on another thread must confine: FX's patcher and tracing flag, the compile session's flag, and
Dynamo's interception of frames (a function run as plain Python)."""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from .dynamo_events import dynamo_callback_handler
from .entry import CountingBackend, Entry, Obsolete, fresh

__all__ = ["ENTRIES", "compile_session_owner", "fx_patcher", "fx_tracing_check", "run_as_plain_python"]


def fx_patcher() -> type:
    """FX's tracer patches ``nn.Module.__call__`` process-wide through this class while it traces; the background
    compile confines those patches to its thread."""
    from torch.fx import _symbolic_trace

    return _symbolic_trace._Patcher


def fx_tracing_check() -> Optional[Tuple[Any, str]]:
    """(owner, name) of FX's ``is_fx_symbolic_tracing`` where it reads one process-wide flag that FX's tracer (and
    so AOTAutograd's, on a compile thread) sets while it traces (through 2.13); None where the flag is per thread
    (2.14). The function ``torch.compile`` returns checks it before each call, and refuses to run ("FX to
    symbolically trace a dynamo-optimized function") while it is true; it takes the function when
    ``torch.compile`` is called."""
    from torch.fx import _symbolic_trace

    return None if hasattr(_symbolic_trace, "_is_fx_tracing_tls") else (_symbolic_trace, "is_fx_symbolic_tracing")


def _set_fx_tracing_flag(value: bool) -> bool:
    """Set FX's tracing flag (this thread's from 2.14); returns the value it had."""
    from torch.fx import _symbolic_trace

    if hasattr(_symbolic_trace, "_is_fx_tracing_tls"):
        previous = _symbolic_trace._get_is_fx_tracing()
        _symbolic_trace._set_is_fx_tracing(value)
        return previous
    previous, _symbolic_trace._is_fx_tracing_flag = _symbolic_trace._is_fx_tracing_flag, value
    return previous


# torch.compiler._compile_session_context() holds torch.compiler._is_compiling_flag, which is_compiling() reads,
# True for a whole Dynamo compile (convert_frame's compile_inner enters it): one flag for the process, so a compile
# on one thread makes is_compiling() true on every other. Dynamo folds the is_compiling() calls it traces to True
# without reading the flag. A torch without this context manager has no such flag to confine.
_COMPILE_SESSION = "_compile_session_context"


def compile_session_owner() -> Optional[Tuple[Any, str]]:
    """(owner, name) of the context manager that sets the process-wide compiling flag, or None on a torch
    without one."""
    return (torch.compiler, _COMPILE_SESSION) if hasattr(torch.compiler, _COMPILE_SESSION) else None


def run_as_plain_python(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its frames never compiled by Dynamo, nor a graph broken on them: Dynamo intercepts each new
    frame under compiled code and would otherwise compile a function that a thread swapped in meanwhile (the frames
    it calls are treated as usual). Returns ``function``."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(function.__code__)
    return function


# -- The probes --------------------------------------------------------------------------------------------


def _probe_fx_tracing_check() -> None:
    """The check that the compiled function captures: with the flag set, one made under a blind check runs (and
    compiles), one made under FX's own refuses; where the flag is per thread, another thread's does not count."""
    from torch.fx import _symbolic_trace

    check = fx_tracing_check()
    blind = None
    if check is not None:
        owner, name = check
        original = getattr(owner, name)
        try:
            setattr(owner, name, lambda: False)
            blind = torch.compile(lambda x: x + 1, backend="eager")
        finally:
            setattr(owner, name, original)
    else:
        seen: List[bool] = []
        other = threading.Thread(
            target=lambda: (_set_fx_tracing_flag(True), seen.append(_symbolic_trace.is_fx_tracing()))
        )
        other.start()
        other.join()
        assert seen == [True] and not _symbolic_trace.is_fx_tracing(), "another thread's flag is its own"
    plain = torch.compile(lambda x: x + 2, backend="eager")
    previous = _set_fx_tracing_flag(True)
    try:
        assert _symbolic_trace.is_fx_symbolic_tracing(), "the flag is what the check reads"
        if blind is not None:
            assert torch.equal(blind(torch.ones(1)), torch.full((1,), 2.0))
        try:
            plain(torch.ones(1))
            refused = False
        except RuntimeError as error:
            refused = "symbolically trace" in str(error)
        assert refused, "a compiled function refuses to run while FX traces"
    finally:
        _set_fx_tracing_flag(previous)


def _probe_fx_patcher() -> None:
    """FX's tracer patches ``nn.Module.__call__`` through ``_Patcher.patch_method(cls, name, new_fn, ...)``."""
    patcher = fx_patcher()
    original = patcher.patch_method
    patched = []

    def recording(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        patched.append((cls, name))
        return original(self, cls, name, new_fn, deduplicate)

    patcher.patch_method = recording
    try:
        torch.fx.symbolic_trace(nn.Linear(2, 2))
    finally:
        patcher.patch_method = original
    assert (nn.Module, "__call__") in patched, patched


def _probe_compile_session() -> None:
    owner = compile_session_owner()
    if owner is None:
        return
    with getattr(*owner)():
        assert torch.compiler.is_compiling(), "is_compiling() no longer reads the compile session's flag"
    assert not torch.compiler.is_compiling()


def _call_module(module: torch.nn.Module, *args: Any) -> Any:
    return torch.nn.Module.__call__(module, *args)


def _frames_compiled_past_a_break(call: Callable[..., Any]) -> int:
    """Dynamo compiles of one call of a compiled module that calls its part through ``call``, a ``__call__`` as a
    thread swaps one in, past the break at the part's disabled forward."""

    class Part(torch.nn.Module):
        __call__ = call

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class Around(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.part = Part()
            self.part.forward = torch.compiler.disable(self.part.forward)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.part(x * 2)

    starts: List[Any] = []
    handler = dynamo_callback_handler()
    handler.register_start_callback(starts.append)
    try:
        assert torch.compile(Around(), backend=CountingBackend())(torch.ones(2)).tolist() == [3.0, 3.0]
    finally:
        handler.remove_start_callback(starts.append)
    return len(starts)


def _probe_run_as_plain_python() -> None:
    compiled = _frames_compiled_past_a_break(fresh(_call_module))
    plain = _frames_compiled_past_a_break(run_as_plain_python(fresh(_call_module)))
    assert plain == compiled - 1, f"the swapped-in __call__'s frame: {compiled} compiles unmarked, {plain} marked"


ENTRIES = [
    Entry(
        "fx_patcher",
        _probe_fx_patcher,
        reaches=("torch.fx._symbolic_trace._Patcher",),
        checked=("2.9.1", "2.13"),
        upstream=("https://github.com/pytorch/pytorch/pull/187589",),
    ),
    Entry(
        "fx_tracing_check",
        _probe_fx_tracing_check,
        reaches=(
            "torch.fx._symbolic_trace.is_fx_symbolic_tracing",
            "torch.fx._symbolic_trace._is_fx_tracing_flag",
            "torch.fx._symbolic_trace._is_fx_tracing_tls",
        ),
        checked=("2.9.1", "2.13", "2.14.1"),
        upstream=("https://github.com/pytorch/pytorch/issues/126024", "https://github.com/pytorch/pytorch/pull/187589"),
        obsolete=(
            Obsolete(
                (2, 14),
                "the process-wide flag's branches of fx_tracing_check and _set_fx_tracing_flag (FX's flag is per "
                "thread from 2.14), and what compiling/thread_guards.py does with the check it returns",
            ),
        ),
    ),
    Entry(
        "compile_session_owner",
        _probe_compile_session,
        reaches=("torch.compiler.is_compiling", "torch.compiler._compile_session_context"),
        checked=("2.13",),
        upstream=("https://github.com/pytorch/pytorch/pull/184614",),
    ),
    Entry(
        "run_as_plain_python",
        _probe_run_as_plain_python,
        reaches=("torch._dynamo.eval_frame.skip_code",),
        checked=("2.9.1", "2.13", "2.14.1"),
    ),
]
