"""What compile telemetry returns: the events (recompiles, graph breaks, fallbacks), the distinct graph breaks and
each region's compile stats; and how Dynamo's compile ids and failed guards read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

OUTSIDE_REGIONS = "outside_regions"
# Compiles in a phase named so (``shapes.warmup``: one graph per bucket, on purpose) are not recompiles.
WARMUP_PHASE = "warm-up"
EVENT_COLUMNS = ("kind", "region", "phase", "step", "compile_id", "reason", "location", "fix")


def split_compile_id(compile_id: str) -> Tuple[str, int]:
    """``"3/1"`` -> ``("3", 1)``; compiled-autograd ids carry a prefix (``"!0/3/1"``)."""
    match = re.search(r"(\d+)/(\d+)\s*\]?$", compile_id or "")
    if match is None:
        return compile_id or "?", 0
    return match.group(1), int(match.group(2))


def first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def guard_text(recompile_reason: Optional[str]) -> str:
    """The failed guard of a recompile, without Dynamo's ``"0/0: "`` cache-entry prefix."""
    line = re.sub(r"^\d+/\d+:\s*", "", first_line(recompile_reason or ""))
    guard_and_source = [re.sub(r"\s+", " ", part).strip() for part in line.split(" # ")[:2]]
    return "  # ".join(guard_and_source)  # the rest of the line is a truncated path


@dataclass
class CompileEvent:
    """A recompile, a graph break, a frame that fell back to eager, a region hitting the recompile limit, or a
    graph that runs without the CUDA graphs its policy asked for."""

    kind: str  # "recompile", "graph_break", "eager_fallback", "recompile_limit", "cudagraph_skip"
    region: str
    phase: str
    step: Optional[int]
    compile_id: str
    reason: str
    location: str = ""
    fix: str = ""

    def row(self) -> List[Any]:
        return [getattr(self, name) for name in EVENT_COLUMNS]


@dataclass
class GraphBreak:
    """One distinct graph break: a reason at a user source location, in a region."""

    region: str
    reason: str
    location: str  # "file:line" of the innermost user frame
    function: str
    declared: bool  # caused by an `eager` rule of the policy
    count: int = 0  # how often Dynamo met it (once per compile that traced it)
    step: Optional[int] = None  # first seen

    @property
    def short_reason(self) -> str:
        return first_line(self.reason)


@dataclass
class RegionStats:
    """Per region (one compiled entry: all the blocks that share it, or one module)."""

    label: str
    modules: List[str] = field(default_factory=list)
    compiles: int = 0  # frame compiles: first ones, grad-mode variants and recompiles
    recompiles: int = 0
    # The first graph of a frame under another grad mode (validation under no_grad), or, under one grad mode, for
    # input tensors that require grad where its graph's did not or the other way round (a block stack whose first
    # block takes the batch, the others activations): expected, not a recompile.
    grad_mode_variants: int = 0
    graphs: int = 0
    compile_time_s: float = 0.0  # frames, lazy backward and CUDA-graph recording
    recompile_time_s: float = 0.0  # the part of compile_time_s spent in recompiles
    graph_breaks: int = 0  # distinct breaks (CompileTelemetry.graph_breaks) that no eager rule declared
    declared_graph_breaks: int = 0  # distinct breaks that an eager rule declared
    limit_hits: int = 0
    cudagraph_skips: int = 0  # graphs asked to use CUDA graphs that run without them
    # Lookups in torch's compile caches (Inductor's FX graphs, AOTAutograd) during its compiles: a loaded bundle
    # or a warm local cache turns misses into hits.
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass
class CompileRecord:
    """One compile, as the compile callbacks saw it; the telemetry finishes it once its compilation metrics are read."""

    compile_id: str
    trigger: str
    entry: Optional[str]
    phase: str
    step: Optional[int]
    started: float
    grad_enabled: bool
    breaks_before: int
    graphs_before: int
    cudagraph_skips_before: int
    cache_before: Tuple[int, int]
    # The functions the compiled frame closes over (compat.functions_closed_over): a decorator's wrapper serves
    # several functions with one code object, so Dynamo numbers a second function's first compile as a recompile
    functions: Tuple[int, ...] = ()
    seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    graphs: int = 0
    breaks: list = field(default_factory=list)
    cudagraph_skips: int = 0
    recompile: bool = False  # a frame compile that counts as a recompile (its lazy backward too)


@dataclass
class Where:
    """When an event happened: the compile id, the phase and the step (a compile's record has the same three)."""

    compile_id: str
    phase: str
    step: Optional[int]
