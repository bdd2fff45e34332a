"""Dynamo's compile events and counters: its start/end callbacks, compilation metrics, graph breaks, graphs."""

from __future__ import annotations

import inspect
import re
import sys
import types
from typing import Any, Callable, List, Tuple

import torch

from .entry import Entry, double, double_with_break, fresh

__all__ = [
    "ENTRIES",
    "compilation_metrics",
    "dynamo_callback_handler",
    "functions_closed_over",
    "graph_break_reasons",
    "unique_graphs",
]


def dynamo_callback_handler() -> Any:
    """Compile start/end callbacks with a trigger and a compile id. ``torch._dynamo.reset()`` clears the
    handlers: register again after a reset."""
    from torch._dynamo.callback import callback_handler

    return callback_handler


def compilation_metrics() -> Any:
    """Dynamo's bounded deque of ``CompilationMetrics`` (fields vary by version: read with ``getattr``;
    ``recompile_reason`` from 2.7)."""
    return torch._dynamo.utils.get_compilation_metrics()


def functions_closed_over() -> Tuple[int, ...]:
    """From a Dynamo compile-start callback: the functions the frame being compiled closes over (the ``id`` of each
    closure cell holding one), read from the arguments of ``convert_frame._compile`` on the stack. A decorator's
    wrapper is one code object serving every function it wraps, told apart by its ``func`` cell: Dynamo caches its
    graphs per code object, so the second function's first compile reads as a recompile. () where the frame closes
    over no function (or ``_compile`` is not on the stack)."""
    from torch._dynamo import convert_frame

    target = inspect.unwrap(convert_frame._compile).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not target:
        frame = frame.f_back
    if frame is None:
        return ()
    contents = []
    for cell in frame.f_locals.get("closure") or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return tuple(id(value) for value in contents if isinstance(value, (types.FunctionType, types.MethodType)))


def graph_break_reasons() -> list:
    """One ``GraphCompileReason`` per graph break (the list ``torch._dynamo.explain`` reads)."""
    reasons = getattr(torch._dynamo.utils, "graph_break_reasons", None)
    if reasons is None:  # pragma: no cover
        raise RuntimeError(f"torch {torch.__version__} has no torch._dynamo.utils.graph_break_reasons")
    return reasons


def unique_graphs() -> int:
    """Graphs Dynamo has compiled in this process (``counters["stats"]``; process-wide, never reset)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# -- The probes --------------------------------------------------------------------------------------------


def _probe_callback_handler() -> None:
    handler = dynamo_callback_handler()
    seen: List[Tuple[str, str, str]] = []

    def on_start(args: Any) -> None:
        seen.append(("start", args.callback_trigger.name, str(args.compile_id)))

    def on_end(args: Any) -> None:
        seen.append(("end", args.callback_trigger.name, str(args.compile_id)))

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)
    try:
        assert on_start in handler.start_callbacks and on_end in handler.end_callbacks
        torch.compile(fresh(double), backend="eager")(torch.ones(2))
    finally:
        handler.remove_start_callback(on_start)
        handler.remove_end_callback(on_end)
    assert on_start not in handler.start_callbacks and on_end not in handler.end_callbacks
    assert [event[:2] for event in seen] == [("start", "DYNAMO"), ("end", "DYNAMO")], seen
    assert seen[0][2] == seen[1][2] and re.fullmatch(r"\d+/\d+", seen[0][2]), seen


def _probe_functions_closed_over() -> None:
    handler = dynamo_callback_handler()
    seen: List[Tuple[int, ...]] = []

    def on_start(args: Any) -> None:
        seen.append(functions_closed_over())

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(x: torch.Tensor) -> torch.Tensor:
            return function(x)

        return wrapper

    wrapped = [fresh(double), fresh(double)]
    first = fresh(wrap(wrapped[0]))  # a code object of its own, then a second function sharing it
    second = types.FunctionType(first.__code__, first.__globals__, first.__name__, None, (types.CellType(wrapped[1]),))
    handler.register_start_callback(on_start)
    try:
        for function in (first, second):
            torch.compile(function, backend="eager")(torch.ones(2))
    finally:
        handler.remove_start_callback(on_start)
    assert seen == [(id(wrapped[0]),), (id(wrapped[1]),)], seen


def _probe_compilation_metrics() -> None:
    """The fields the telemetry reads: the frame (name, file, line), the compile id, a recompile's reason."""
    function = fresh(double)
    compiled = torch.compile(function, backend="eager", dynamic=False)
    compiled(torch.ones(2))
    first = list(compilation_metrics())[-1]
    assert first.co_name == function.__name__ and first.co_filename == double.__code__.co_filename, first
    assert first.co_firstlineno == double.__code__.co_firstlineno and re.fullmatch(r"\d+/0", str(first.compile_id))
    compiled(torch.ones(3))
    recompile = list(compilation_metrics())[-1]
    assert str(recompile.compile_id) == str(first.compile_id).replace("/0", "/1"), recompile.compile_id
    assert isinstance(recompile.recompile_reason, str) and "size mismatch" in recompile.recompile_reason


def _probe_graph_breaks() -> None:
    """A graph break adds a reason with its user stack, and each graph counts in ``unique_graphs``."""
    reasons, graphs = len(graph_break_reasons()), unique_graphs()
    torch.compile(fresh(double_with_break), backend="eager")(torch.ones(2))
    added = graph_break_reasons()[reasons:]
    assert added and isinstance(added[-1].reason, str) and isinstance(list(added[-1].user_stack), list), added
    assert unique_graphs() - graphs == 2, "one graph before the break, one after"


ENTRIES = [
    Entry(
        "dynamo_callback_handler",
        _probe_callback_handler,
        reaches=("torch._dynamo.callback.callback_handler",),
        checked=("2.9.1", "2.13"),
        upstream=("https://github.com/pytorch/pytorch/pull/120764", "https://github.com/pytorch/pytorch/pull/153596"),
    ),
    Entry(
        "compilation_metrics",
        _probe_compilation_metrics,
        reaches=("torch._dynamo.utils.get_compilation_metrics",),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "functions_closed_over",
        _probe_functions_closed_over,
        reaches=("torch._dynamo.convert_frame._compile",),
        checked=("2.9.1", "2.13", "2.14.1"),
    ),
    Entry(
        "graph_break_reasons",
        _probe_graph_breaks,
        reaches=("torch._dynamo.utils.graph_break_reasons", "torch._dynamo.utils.counters"),
        checked=("2.9.1", "2.13"),
    ),
]
