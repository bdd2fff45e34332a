"""The backend every region compiles with: the named one, plus two things it does to the graphs it compiled.

**Compiling without running** (a background thread). Dynamo compiles a region at its first call and then runs the
graph. A background compile needs only the first half: running the graph there would touch state that the training
thread is using at the same time (CUDA graph warm-up clears cuBLAS workspaces and switches memory pools: it crashed
the process on an H100), draw from the shared random-number generators, and hold a second step's activations in
memory. ``RegionBackend`` compiles exactly as the named backend does; inside ``compile_only()`` its compiled graph
raises ``CompiledNotRun`` instead of running, on that thread only. The Dynamo cache entry it created is the one the
training thread's calls then hit, so they run the same compiled graph. Inside ``compile_only()`` the thread is also
guarded (``compile_trainer.compiling.thread_guards``): the compilers' process-wide side effects made on it
(random-number restores, FX's method patches) stay on it.

**Showing each graph call to an observer** (the telemetry's FLOPs count). Inside ``observing_graph_calls(observer)``
each call of a compiled graph on that thread goes through ``observer(graph, compiled, args)``, which must return
``compiled(*args)``; ``graph`` is a copy of the FX graph Dynamo handed to the backend, taken before the backend's
own passes changed it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from compile_trainer import compat
from compile_trainer.compiling.thread_guards import guarded_thread

_thread = threading.local()


class CompiledNotRun(Exception):
    """Raised, inside ``compile_only()``, where a freshly compiled graph would have run."""


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """On this thread, compiled graphs of a ``RegionBackend`` raise ``CompiledNotRun`` instead of running;
    the thread is guarded (``thread_guards.guarded_thread``)."""
    previous = getattr(_thread, "compile_only", False)
    _thread.compile_only = True
    try:
        with guarded_thread():
            yield
    finally:
        _thread.compile_only = previous


GraphObserver = Callable[[torch.fx.GraphModule, Callable[..., Any], Tuple[Any, ...]], Any]


@contextlib.contextmanager
def observing_graph_calls(observer: GraphObserver) -> Iterator[None]:
    """On this thread, each call of a ``RegionBackend``'s compiled graph is ``observer(graph, compiled, args)``."""
    previous = getattr(_thread, "observer", None)
    _thread.observer = observer
    try:
        yield
    finally:
        _thread.observer = previous


def _graph_copy(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same code on the same attributes, in a graph of its own (backends rewrite theirs in place)."""
    copied = torch.fx.Graph()
    copied.output(copied.graph_copy(graph.graph, {}))
    return torch.fx.GraphModule(graph, copied)


class RegionBackend:
    """The ``torch.compile`` backend named ``backend`` (Inductor with ``mode`` and ``options``), with graphs
    that do not run inside ``compile_only()`` and that show their calls to an observer inside
    ``observing_graph_calls()``. Equal settings make equal backends: Dynamo reuses a cache entry only under a
    backend equal to the one that created it."""

    def __init__(self, backend: str, mode: Optional[str], options: Optional[Dict[str, Any]], dynamic: Optional[bool]):
        self.key = (backend, mode, repr(sorted((options or {}).items())), dynamic)
        if backend == "inductor":
            self.inner: Callable[..., Any] = compat.inductor_backend(mode, options, dynamic)
        else:
            self.inner = compat.lookup_backend(backend)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        observed = _graph_copy(graph)
        compiled = self.inner(graph, example_inputs)

        def run(*args: Any) -> Any:
            if getattr(_thread, "compile_only", False):
                raise CompiledNotRun
            observer = getattr(_thread, "observer", None)
            return compiled(*args) if observer is None else observer(observed, compiled, args)

        return run

    def __eq__(self, other: object) -> bool:  # Dynamo compares backends to reuse a cache entry
        return isinstance(other, RegionBackend) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def reset(self) -> None:  # torch._dynamo.reset() calls it: Inductor clears its CUDA graph trees
        getattr(self.inner, "reset", lambda: None)()
