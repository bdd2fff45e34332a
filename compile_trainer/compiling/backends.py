"""A backend that a background thread can compile with, without running what it compiled.

Dynamo compiles a region at its first call and then runs the graph. A background compile needs only the
first half: running the graph there would touch state that the training thread is using at the same time
(CUDA graph warm-up clears cuBLAS workspaces and switches memory pools: it crashed the process on an
H100), draw from the shared random-number generators, and hold a second step's activations in memory.
``CompileOnlyBackend`` compiles exactly as the named backend does; inside ``compile_only()`` its compiled
graph raises ``CompiledNotRun`` instead of running, on that thread only. The Dynamo cache entry it
created is the one the training thread's calls then hit, so they run the same compiled graph.

Inside ``compile_only()`` the thread is also guarded (``compile_trainer.compiling.thread_guards``): the compilers'
process-wide side effects made on it (random-number restores, FX's method patches) stay on it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from compile_trainer import compat
from compile_trainer.compiling.thread_guards import guarded_thread

_thread = threading.local()


class CompiledNotRun(Exception):
    """Raised, inside ``compile_only()``, where a freshly compiled graph would have run."""


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """On this thread, compiled graphs of a ``CompileOnlyBackend`` raise ``CompiledNotRun`` instead of running;
    the thread is guarded (``thread_guards.guarded_thread``)."""
    previous = getattr(_thread, "compile_only", False)
    _thread.compile_only = True
    try:
        with guarded_thread():
            yield
    finally:
        _thread.compile_only = previous


class CompileOnlyBackend:
    """The ``torch.compile`` backend named ``backend`` (Inductor with ``mode`` and ``options``), with graphs
    that do not run inside ``compile_only()``. Equal settings make equal backends: Dynamo reuses a cache
    entry only under a backend equal to the one that created it."""

    def __init__(self, backend: str, mode: Optional[str], options: Optional[Dict[str, Any]], dynamic: Optional[bool]):
        self.key = (backend, mode, repr(sorted((options or {}).items())), dynamic)
        if backend == "inductor":
            self.inner: Callable[..., Any] = compat.inductor_backend(mode, options, dynamic)
        else:
            self.inner = compat.lookup_backend(backend)

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
