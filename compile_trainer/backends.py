"""A backend that a background thread can compile with, without running what it compiled.

Dynamo compiles a region at its first call and then runs the graph. A background compile needs only the
first half: running the graph there would touch state that the training thread is using at the same time
(CUDA graph warm-up clears cuBLAS workspaces and switches memory pools: it crashed the process on an
H100), draw from the shared random-number generators, and hold a second step's activations in memory.
``CompileOnlyBackend`` compiles exactly as the named backend does; inside ``compile_only()`` its compiled
graph raises ``CompiledNotRun`` instead of running, on that thread only. The Dynamo cache entry it
created is the one the training thread's calls then hit, so they run the same compiled graph.

Dynamo, AOTAutograd and Inductor save the process-wide random-number state (torch's CPU and CUDA generators,
Python's ``random``) before they compile and restore it after, to undo draws made while tracing. On a second
thread that restore rewinds the training thread's generators: draws it made meanwhile (dropout masks) come
again. Inside ``compile_only()`` those restores are skipped on that thread; it runs nothing, so it has drawn
nothing to undo.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

_thread = threading.local()
# The functions the compilers restore random-number state with, as (owner, attribute).
RNG_RESTORES: Tuple[Tuple[Any, str], ...] = (
    (torch.random, "set_rng_state"),
    (torch.cuda, "set_rng_state"),
    (random, "setstate"),
)
_rng_lock = threading.Lock()
_compile_only_threads: Set[int] = set()
_rng_restores: Dict[Tuple[Any, str], Callable[..., Any]] = {}  # the originals, while patched


class CompiledNotRun(Exception):
    """Raised, inside ``compile_only()``, where a freshly compiled graph would have run."""


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """On this thread, compiled graphs of a ``CompileOnlyBackend`` raise ``CompiledNotRun`` instead of running,
    and the compilers' random-number state restores do nothing (other threads' calls go through)."""
    previous = getattr(_thread, "compile_only", False)
    _thread.compile_only = True
    if not previous:
        _skip_rng_restores_on_this_thread(True)
    try:
        yield
    finally:
        if not previous:
            _skip_rng_restores_on_this_thread(False)
        _thread.compile_only = previous


def _skip_rng_restores_on_this_thread(skip: bool) -> None:
    """Patch the restore functions while any thread is compile-only; put the originals back after the last."""
    with _rng_lock:
        if skip and not _compile_only_threads:
            for owner, name in RNG_RESTORES:
                _rng_restores[(owner, name)] = original = getattr(owner, name)
                setattr(owner, name, _skipped_on_compile_only_threads(original))
        (_compile_only_threads.add if skip else _compile_only_threads.discard)(threading.get_ident())
        if not skip and not _compile_only_threads:
            for (owner, name), original in _rng_restores.items():
                setattr(owner, name, original)
            _rng_restores.clear()


def _skipped_on_compile_only_threads(restore: Callable[..., Any]) -> Callable[..., Any]:
    def restore_unless_compile_only(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in _compile_only_threads:
            return restore(*args, **kwargs)
        return None

    return restore_unless_compile_only


class CompileOnlyBackend:
    """The ``torch.compile`` backend named ``backend`` (Inductor with ``mode`` and ``options``), with graphs
    that do not run inside ``compile_only()``. Equal settings make equal backends: Dynamo reuses a cache
    entry only under a backend equal to the one that created it."""

    def __init__(self, backend: str, mode: Optional[str], options: Optional[Dict[str, Any]], dynamic: Optional[bool]):
        self.key = (backend, mode, repr(sorted((options or {}).items())), dynamic)
        if backend == "inductor":
            self.inner: Callable[..., Any] = torch._TorchCompileInductorWrapper(mode, options, dynamic)
        else:
            self.inner = torch._dynamo.lookup_backend(backend)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        compiled = self.inner(graph, example_inputs)

        def run(*args: Any) -> Any:
            if getattr(_thread, "compile_only", False):
                raise CompiledNotRun
            return compiled(*args)

        return run

    def __eq__(self, other: object) -> bool:  # Dynamo compares backends to reuse a cache entry
        return isinstance(other, CompileOnlyBackend) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def reset(self) -> None:  # torch._dynamo.reset() calls it: Inductor clears its CUDA graph trees
        getattr(self.inner, "reset", lambda: None)()
