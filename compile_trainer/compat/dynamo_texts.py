"""Dynamo's texts, matched where it gives no structured field: recompile reasons, failures, traced errors."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch

from .dynamo_events import compilation_metrics
from .entry import Entry, Obsolete, double, fresh, torch_version

__all__ = [
    "ENTRIES",
    "GRAD_MODE_GUARD",
    "REQUIRES_GRAD_GUARD",
    "is_fail_on_recompile",
    "is_recompile_limit",
    "reports_frames_run_eagerly_at_a_loop_break",
    "traced_error_summary",
]

_FAIL_ON_RECOMPILE = "fail_on_recompile"  # the RuntimeError under set_stance("fail_on_recompile")
GRAD_MODE_GUARD = "GLOBAL_STATE changed: grad_mode"  # recompile_reason when the graph checked was another grad mode's
# recompile_reason when an input tensor requires grad and the graph's did not, or the other way round:
# "tensor 'args[0]' requires_grad mismatch. expected requires_grad=0"
REQUIRES_GRAD_GUARD = re.compile(r"^tensor '[^']+' requires_grad mismatch")
# fail_reason at the limit: "recompile_limit reached" (2.9.1), "recompile limit" (2.10+), "cache_size_limit" before
_RECOMPILE_LIMIT_TEXTS = ("recompile limit", "recompile_limit", "cache_size_limit")


def is_fail_on_recompile(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and _FAIL_ON_RECOMPILE in str(error)


def is_recompile_limit(fail_reason: str) -> bool:
    return any(text in fail_reason.lower() for text in _RECOMPILE_LIMIT_TEXTS)


def _loop_with_a_break(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = x + 1
        torch._dynamo.graph_break()
    return x


@functools.cache
def reports_frames_run_eagerly_at_a_loop_break() -> bool:
    """Whether a frame Dynamo runs eagerly because a graph break sits in a loop has a ``fail_type`` in its compile
    metrics (2.13, 2.14.1). torch 2.9.1 records it like a frame with no tensor code (no failure, no graph, no
    counter): such a fallback cannot be told apart there, and is not reported. Found by compiling one such loop."""
    torch.compile(fresh(_loop_with_a_break), backend="eager")(torch.ones(1))
    return getattr(compilation_metrics()[-1], "fail_type", None) is not None


# Dynamo's errors end with the user frames it traced ('from user code:', each 'File "f", line n, in name' and the
# line's code); where the traced code raised, the debug context names the exception (2.13, 2.14.1)
_TRACED_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+(?:\n[ \t]+(\S.*))?')
_TRACED_EXCEPTION = re.compile(r"raised exception (.+)")


def traced_error_summary(error: BaseException) -> str:
    """A Dynamo error in one line: what failed (the exception the traced code raised, else the message's first line)
    and the last user line it traced (``file.py:line `code```). Another error: its type and first line."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # "backend='inductor' raised:" and the backend's error below it
        first = f"{first} {lines[1]}"
    first = " ".join(first.split())[:200]  # Dynamo's can run on for a paragraph
    raised = _TRACED_EXCEPTION.search(text)
    if raised:
        what = raised.group(1).strip()
    else:
        what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    frames = _TRACED_USER_FRAME.findall(text)
    if not frames:
        return what
    file, line, code = frames[-1]
    return f"{what} at {os.path.basename(file)}:{line}" + (f" `{code.strip()}`" if code else "")


# -- The probes --------------------------------------------------------------------------------------------


def _probe_grad_mode_guard() -> None:
    """A recompile for another grad mode is told apart by its reason's text (validation under no_grad)."""
    compiled = torch.compile(fresh(double), backend="eager")
    compiled(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        compiled(torch.ones(2, requires_grad=True))
    reason = list(compilation_metrics())[-1].recompile_reason
    assert GRAD_MODE_GUARD in reason, reason


def _probe_requires_grad_guard() -> None:
    """A recompile for an input that requires grad where the graph's did not is told apart by its reason's text
    (the first block of a stack fed the batch, the later ones activations)."""
    compiled = torch.compile(fresh(double), backend="eager")
    compiled(torch.ones(2))
    compiled(torch.ones(2, requires_grad=True))
    reason = re.sub(r"^\d+/\d+:\s*", "", list(compilation_metrics())[-1].recompile_reason)
    assert REQUIRES_GRAD_GUARD.match(reason), reason


def _probe_fail_on_recompile() -> None:
    compiled = torch.compile(fresh(double), backend="eager", dynamic=False)
    compiled(torch.ones(2))
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled(torch.ones(3))
    except RuntimeError as error:
        assert is_fail_on_recompile(error), str(error)
    else:
        raise AssertionError("set_stance('fail_on_recompile') let a recompile through")


def _probe_traced_error_summary() -> None:
    def unpack(x: torch.Tensor, pair: Any = None) -> torch.Tensor:
        first, second = pair
        return x * first

    try:
        torch.compile(unpack, backend="eager", fullgraph=True)(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the error is what is probed
        summary = traced_error_summary(error)
    else:
        raise AssertionError("unpacking None compiled")
    assert re.search(r" at dynamo_texts\.py:\d+ `first, second = pair`$", summary), summary
    assert traced_error_summary(TypeError("forward() missing 1 required positional argument: 'gate'")) == (
        "TypeError: forward() missing 1 required positional argument: 'gate'"
    )

    def fails(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise RuntimeError("this backend compiles nothing")

    try:
        torch.compile(lambda x: x.sin(), backend=fails)(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the error is what is probed
        summary = traced_error_summary(error)
    assert summary.endswith("raised: RuntimeError: this backend compiles nothing"), summary


def _probe_loop_break_reports() -> None:
    reported, version = reports_frames_run_eagerly_at_a_loop_break(), torch_version()
    if version[:2] in ((2, 9), (2, 13), (2, 14)):  # the versions it was checked on
        assert reported == (version >= (2, 13)), f"torch {torch.__version__}: reported={reported}"


ENTRIES = [
    Entry(
        "GRAD_MODE_GUARD",
        _probe_grad_mode_guard,
        reaches=("torch._C._dynamo.guards.GlobalStateGuard",),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "REQUIRES_GRAD_GUARD",
        _probe_requires_grad_guard,
        reaches=("torch._dynamo.guards.GuardBuilder.TENSOR_MATCH",),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "is_fail_on_recompile",
        _probe_fail_on_recompile,
        reaches=("torch.compiler.set_stance", "torch._dynamo.eval_frame"),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "traced_error_summary",
        _probe_traced_error_summary,
        reaches=("torch._dynamo.exc.augment_exc_message", "torch._dynamo.symbolic_convert"),
        checked=("2.9.1", "2.13", "2.14.1"),
    ),
    Entry(
        "reports_frames_run_eagerly_at_a_loop_break",
        _probe_loop_break_reports,
        reaches=("torch._dynamo.utils.get_compilation_metrics",),
        checked=("2.9.1", "2.13", "2.14.1"),
        obsolete=(
            Obsolete(
                (2, 13),
                "reports_frames_run_eagerly_at_a_loop_break (True on every torch from 2.13) and its check in "
                "tests/test_telemetry.py",
            ),
        ),
    ),
]
