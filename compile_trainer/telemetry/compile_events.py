"""Compile telemetry: what Dynamo compiled, recompiled and broke, attributed to the policy's regions.

Everything is read in-process from PyTorch's structured sources, never from stderr:

- the compile start/end callbacks (``torch._dynamo.callback.callback_handler``): each compile's id
  (``"frame/attempt"``; attempt > 0 is a recompile), its trigger (a frame, a lazy backward, CUDA-graph
  recording) and its wall time. ``torch._dynamo.reset()`` clears them, so ``ensure_installed()`` re-registers;
- ``torch._dynamo.utils.graph_break_reasons``: one ``GraphCompileReason`` per graph break, with the reason
  and the user stack (the list ``torch._dynamo.explain`` reads);
- ``torch._dynamo.utils.counters``: process-wide, so diffed around each compile (unique graphs);
- ``get_compilation_metrics()``: the compiled frame's code name and file, the guard that failed for a
  recompile, frames that fell back to eager (the recompile limit, breaks Dynamo cannot resume from).

Attribution: ``apply_policy`` compiles every region through an entry function whose code name is
``compiled_region__<Class>[_n]`` (``CompiledRegion.entry_name``). A compile belongs to the region whose
entry is the compiled frame itself or is on the Python stack when the compile starts (frames that a
graph break split off run below it); a lazy backward compile shares its forward's compile id.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling.regions import ENTRY_PREFIX, AppliedPolicy
from compile_trainer.tables import text_table
from compile_trainer.telemetry.fixes import recompile_fix, suggest_fix

log = logging.getLogger(__name__)

TORCH_DIR = str(Path(torch.__file__).resolve().parent)
APPLY_FILE = str(Path(__file__).resolve().parents[1] / "compiling" / "regions.py")
OUTSIDE_REGIONS = "outside_regions"
# Compiles in a phase named so (``shapes.warmup``: one graph per bucket, on purpose) are not recompiles.
WARMUP_PHASE = "warm-up"
CUDAGRAPH_RECORDING = "CUDAGRAPH_RECORDING"  # the compile callbacks' trigger while Inductor records CUDA graphs
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
    graph_breaks: int = 0
    limit_hits: int = 0
    cudagraph_skips: int = 0  # graphs asked to use CUDA graphs that run without them
    # Lookups in torch's compile caches (Inductor's FX graphs, AOTAutograd) during its compiles: a loaded bundle
    # or a warm local cache turns misses into hits.
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass
class _Compile:
    """One compile, as the callbacks saw it; finished once its compilation metrics are read."""

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


def _cache_lookups() -> Tuple[int, int]:
    """(hits, misses) of torch's compile caches so far, all layers together."""
    counts = compat.cache_counters().values()
    return sum(hits for hits, _ in counts), sum(misses for _, misses in counts)


def region_labels(applied: Optional[AppliedPolicy]) -> Dict[str, Tuple[str, List[str]]]:
    """entry name -> (label, region module names). Blocks sharing an entry are labelled by their container, and
    by their indices in it where entries share a container (Swin's plain and shifted blocks: ``blocks.{0,2,4}``)."""
    groups: Dict[str, List[str]] = {}
    for item in applied.compiled if applied is not None else []:
        groups.setdefault(item.entry_name, []).append(item.region.name)
    by_container = {entry: _blocks_label(names) for entry, names in groups.items() if len(names) > 1}
    entries_per_label = collections.Counter(by_container.values())
    labels = {}
    for entry, names in groups.items():
        if len(names) == 1:
            labels[entry] = (names[0], names)
        elif entries_per_label[by_container[entry]] > 1:
            labels[entry] = (_blocks_label(names, indices=True), names)
        else:
            labels[entry] = (by_container[entry], names)
    for item in applied.compiled if applied is not None else []:
        if item.cache_entry is not None:  # a block's own entry for calls that pass a KV cache
            labels[item.cache_entry.__name__] = (f"{item.region.name} with a KV cache", [item.region.name])
    return labels


def _blocks_label(names: List[str], indices: bool = False) -> str:
    by_container: Dict[str, List[str]] = {}
    for name in names:
        container, _, index = name.rpartition(".")
        by_container.setdefault(container, []).append(index)
    labels = []
    for container, held in sorted(by_container.items()):
        within = f"{{{','.join(held)}}}" if indices else ""
        labels.append(".".join(part for part in (container, within) if part) or "<root>")
    return "+".join(labels)


def _user_frame(stack: list) -> Optional[Any]:
    """The innermost frame of a user stack that is neither torch's nor the policy's entry function."""
    for frame in reversed(stack or []):
        filename = str(Path(frame.filename).resolve()) if frame.filename else ""
        if filename.startswith(TORCH_DIR) or filename == APPLY_FILE or frame.name.startswith(ENTRY_PREFIX):
            continue
        return frame
    return stack[-1] if stack else None


class CompileTelemetry:
    """Collects compile events while installed; ``collect()`` turns what Dynamo recorded into stats.

    Cheap in steady state: nothing runs unless Dynamo compiles. ``step`` and ``phase`` are set by the
    caller (the Lightning callback) so that events say when they happened.
    """

    def __init__(self, applied: Optional[AppliedPolicy] = None, root: Optional[nn.Module] = None):
        self.applied = applied
        self.root = root if root is not None else (applied.root if applied is not None else None)
        self.step: Optional[int] = None
        self.phase = "setup"
        self.compile_count = 0  # compiles started, any trigger: a step during which it changes is a compile step
        self.cudagraph_recordings = 0  # of which CUDA-graph recordings (Inductor's CUDAGRAPH_RECORDING trigger)
        self.compile_time_s = 0.0
        self.unique_graphs = 0
        self.events: List[CompileEvent] = []
        self.breaks: Dict[Tuple[str, str, str], GraphBreak] = {}
        self.regions: Dict[str, RegionStats] = {}
        self.runtime_cudagraph_skips = 0  # skipped when a graph ran, not when it compiled: region unknown
        self._cudagraph_skips_seen = compat.cudagraph_skips()  # Inductor's counter, as far as the events account for it
        self._labels = region_labels(applied)
        for label, names in self._labels.values():
            self.regions[label] = RegionStats(label, names)
        self._declared = self._declared_functions()
        self._installed = False
        self._active: Optional[_Compile] = None
        self._forward: Dict[str, _Compile] = {}  # compile id -> its frame compile, until its metrics arrive
        self._finished: Dict[str, _Compile] = {}  # compile id -> frame compile, for lazy backward attribution
        self._backward: List[_Compile] = []
        self._frame_entry: Dict[str, str] = {}  # frame number -> entry name
        # a compiled function, (frame number, functions its closure holds) -> grad modes it has a graph for
        self._grad_modes: Dict[Tuple[str, Tuple[int, ...]], set] = {}
        self._requires_grad_variants: set = set()  # (compiled function, grad mode) with a requires-grad variant
        self._frame_warned: set = set()
        self._last_metric: Any = None

    # -- installation -------------------------------------------------------------------------------

    def install(self) -> CompileTelemetry:
        metrics = compat.compilation_metrics()
        self._last_metric = metrics[-1] if metrics else None  # earlier compiles are not ours
        self._cudagraph_skips_seen = compat.cudagraph_skips()
        self.ensure_installed()
        return self

    def ensure_installed(self) -> None:
        """Register the callbacks (again, after a ``torch._dynamo.reset()`` cleared them)."""
        handler = compat.dynamo_callback_handler()
        if self._on_start in handler.start_callbacks:
            return
        if self._installed:  # a reset happened: compile ids restart at 0/0
            self._frame_entry.clear()
            self._grad_modes.clear()
            self._requires_grad_variants.clear()
            self._forward.clear()
            self._finished.clear()
        handler.register_start_callback(self._on_start)
        handler.register_end_callback(self._on_end)
        self._installed = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Compiles inside are not the run's (the compile cache's captures trace each region again after
        training): neither counted nor reported, their metrics and counters skipped."""
        self.collect()
        installed = self._installed
        self.uninstall()
        try:
            yield
        finally:
            metrics = compat.compilation_metrics()
            self._last_metric = metrics[-1] if metrics else self._last_metric
            self._cudagraph_skips_seen = compat.cudagraph_skips()
            if installed:
                self.ensure_installed()

    def uninstall(self) -> None:
        handler = compat.dynamo_callback_handler()
        if self._on_start in handler.start_callbacks:
            handler.remove_start_callback(self._on_start)
        if self._on_end in handler.end_callbacks:
            handler.remove_end_callback(self._on_end)
        self._installed = False

    # -- callbacks (run inside Dynamo; keep them small) ---------------------------------------------

    def _on_start(self, args: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        compile_id = str(getattr(args, "compile_id", ""))
        self._read_metrics()
        entry = self._entry_on_stack() if trigger == "DYNAMO" else None
        self._active = _Compile(
            compile_id=compile_id,
            trigger=trigger,
            entry=entry,
            phase=self.phase,
            step=self.step,
            started=time.perf_counter(),
            grad_enabled=torch.is_grad_enabled(),
            breaks_before=len(compat.graph_break_reasons()),
            graphs_before=compat.unique_graphs(),
            cudagraph_skips_before=compat.cudagraph_skips(),
            cache_before=_cache_lookups(),
            functions=compat.functions_closed_over() if trigger == "DYNAMO" else (),
        )
        self.compile_count += 1
        self.cudagraph_recordings += trigger == CUDAGRAPH_RECORDING

    def _on_end(self, args: Any) -> None:
        record, self._active = self._active, None
        if record is None:
            return
        record.seconds = time.perf_counter() - record.started
        record.graphs = compat.unique_graphs() - record.graphs_before
        record.cudagraph_skips = compat.cudagraph_skips() - record.cudagraph_skips_before
        hits, misses = _cache_lookups()
        record.cache_hits, record.cache_misses = hits - record.cache_before[0], misses - record.cache_before[1]
        reasons = compat.graph_break_reasons()
        record.breaks = list(reasons[record.breaks_before :]) if len(reasons) >= record.breaks_before else []
        self.compile_time_s += record.seconds
        if record.trigger == "DYNAMO":
            self._forward[record.compile_id] = record
        else:
            self._backward.append(record)

    @staticmethod
    def _entry_on_stack() -> Optional[str]:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name.startswith(ENTRY_PREFIX):
                return frame.f_code.co_name
            frame = frame.f_back
        return None

    # -- turning records into stats -----------------------------------------------------------------

    def collect(self) -> List[CompileEvent]:
        """Process everything recorded since the last call; return the new events."""
        before = len(self.events)
        self._read_metrics()
        for compile_id in list(self._forward):  # ended, but its metrics fell out of Dynamo's bounded deque
            self._finish(self._forward.pop(compile_id), None)
        for record in self._backward:
            self._finish(record, None)
        self._backward.clear()
        self._runtime_cudagraph_skips()
        return self.events[before:]

    def _read_metrics(self) -> None:
        metrics = compat.compilation_metrics()
        start = 0
        if self._last_metric is not None:
            for index in range(len(metrics) - 1, -1, -1):
                if metrics[index] is self._last_metric:
                    start = index + 1
                    break
        for metric in metrics[start:]:
            self._on_metric(metric)
        if metrics:
            self._last_metric = metrics[-1]

    def _on_metric(self, metric: Any) -> None:
        if getattr(metric, "is_forward", True) is False:
            return  # a backward compile: timed by its LAZY_BACKWARD callbacks
        compile_id = str(getattr(metric, "compile_id", "") or "")
        record = self._forward.pop(compile_id, None)
        if record is not None:
            self._finish(record, metric)
        elif getattr(metric, "fail_type", None):  # refused before any callback ran: the recompile limit
            frame, attempt = split_compile_id(compile_id)
            entry = self._frame_entry.get(frame)
            self._failure(entry, compile_id, attempt, metric, self.phase, self.step)

    def _label(self, entry: Optional[str]) -> str:
        if entry is not None and entry not in self._labels:  # made after the plan: a block's own (block_values)
            self._labels = region_labels(self.applied)
        if entry is not None and entry in self._labels:
            return self._labels[entry][0]
        if entry is not None:
            return entry[len(ENTRY_PREFIX) :]
        return OUTSIDE_REGIONS

    def _stats(self, label: str) -> RegionStats:
        if label not in self.regions:
            self.regions[label] = RegionStats(label)
        return self.regions[label]

    def _finish(self, record: _Compile, metric: Any) -> None:
        frame, attempt = split_compile_id(record.compile_id)
        co_name = getattr(metric, "co_name", None) or ""
        entry = co_name if co_name.startswith(ENTRY_PREFIX) else record.entry
        if entry is None and record.trigger != "DYNAMO":
            forward = self._finished.get(record.compile_id)
            entry = forward.entry if forward is not None else None
        if record.trigger == "DYNAMO":
            record.entry = entry
            if entry is not None:
                self._frame_entry.setdefault(frame, entry)
            self._finished[record.compile_id] = record
        stats = self._stats(self._label(entry))
        stats.compile_time_s += record.seconds
        stats.cache_hits += record.cache_hits
        stats.cache_misses += record.cache_misses
        if record.cudagraph_skips:
            self._cudagraph_skip(stats, record, metric)
        if record.trigger != "DYNAMO":
            forward = self._finished.get(record.compile_id)
            if forward is not None and forward.recompile:
                stats.recompile_time_s += record.seconds
            return
        if getattr(metric, "fail_type", None) and record.phase.startswith(WARMUP_PHASE):
            # a bucket warm-up trace that failed (shapes.bucket_warmup reports it): nothing compiled or ran eagerly
            log.debug("warm-up trace of region %s failed: %s", stats.label, getattr(metric, "fail_reason", ""))
            return
        stats.compiles += 1
        stats.graphs += record.graphs
        self.unique_graphs += record.graphs
        function = (frame, record.functions)  # a frame's code, as the function it serves
        modes = self._grad_modes.setdefault(function, set())
        first_compile = not modes  # of this function (attempt > 0: its code served another function first)
        reason = guard_text(getattr(metric, "recompile_reason", None)) if attempt > 0 else ""
        grad_mode_variant = not first_compile and (
            record.grad_enabled not in modes or self._requires_grad_variant(function, record.grad_enabled, reason)
        )
        modes.add(record.grad_enabled)
        if grad_mode_variant:
            stats.grad_mode_variants += 1
        elif not first_compile:
            reason = reason or "unknown guard (no compilation metrics)"
            if reason.startswith(compat.GRAD_MODE_GUARD):
                # Dynamo names one failed guard, of the graph it checked first: another grad mode's. The graph of
                # this grad mode failed a guard it does not name.
                reason = (
                    "a guard of the graph for this grad mode failed; Dynamo names only another graph's "
                    f"({reason}): TORCH_LOGS=recompiles_verbose shows every failed guard"
                )
            record.recompile = not record.phase.startswith(WARMUP_PHASE)
            if record.recompile:
                stats.recompiles += 1
                stats.recompile_time_s += record.seconds
                self._event("recompile", stats.label, record, reason, fix=recompile_fix(reason, len(stats.modules)))
            self._check_limit(frame, attempt, stats, reason)
        for item in record.breaks:
            self._graph_break(stats, record, item)
        if getattr(metric, "fail_type", None):
            self._failure(entry, record.compile_id, attempt, metric, record.phase, record.step)

    def _requires_grad_variant(self, function: Tuple[str, Tuple[int, ...]], grad_enabled: bool, reason: str) -> bool:
        """Whether a recompile is the function's first for inputs that differ from its graph's in requiring grad
        (under this grad mode): a shared block entry whose first block is fed the batch, the later ones activations."""
        variant = (function, grad_enabled)
        if not compat.REQUIRES_GRAD_GUARD.match(reason) or variant in self._requires_grad_variants:
            return False
        self._requires_grad_variants.add(variant)
        return True

    def _event(
        self, kind: str, label: str, where: Any, reason: str, location: str = "", fix: Optional[str] = None
    ) -> CompileEvent:
        """Record an event; ``where`` has the compile id, phase and step. ``fix`` defaults to one for ``reason``."""
        event = CompileEvent(
            kind=kind,
            region=label,
            phase=where.phase,
            step=where.step,
            compile_id=where.compile_id,
            reason=reason,
            location=location,
            fix=suggest_fix(kind, reason) if fix is None else fix,
        )
        self.events.append(event)
        return event

    def _cudagraph_skip(self, stats: RegionStats, record: _Compile, metric: Any) -> None:
        stats.cudagraph_skips += record.cudagraph_skips
        self._cudagraph_skips_seen += record.cudagraph_skips
        reason = str(getattr(metric, "cudagraph_skip_reason", None) or "") or (
            "reason not reported by Inductor (it reports it only for graphs on a CUDA device)"
        )
        event = self._event("cudagraph_skip", stats.label, record, first_line(reason))
        log.warning("region %s runs without CUDA graphs: %s. Fix: %s", stats.label, event.reason, event.fix)

    def _runtime_cudagraph_skips(self) -> None:
        """Skips counted outside any compile: CUDA graph trees give up on a graph when it runs (an input
        mutated outside the graphs' memory, too many re-recordings), and say why only in a log that is off
        by default."""
        skipped = compat.cudagraph_skips() - self._cudagraph_skips_seen
        if skipped <= 0:
            return
        self._cudagraph_skips_seen += skipped
        self.runtime_cudagraph_skips += skipped
        reason = f"{skipped} graph(s) stopped using CUDA graphs at run time (TORCH_LOGS=cudagraphs shows why)"
        where = _Where("-", self.phase, self.step)
        event = self._event("cudagraph_skip", "-", where, reason)
        log.warning("%s. Fix: %s", reason, event.fix)

    def _graph_break(self, stats: RegionStats, record: _Compile, item: Any) -> None:
        reason = str(getattr(item, "reason", item))
        frame = _user_frame(list(getattr(item, "user_stack", []) or []))
        location = f"{frame.filename}:{frame.lineno}" if frame is not None else ""
        function = frame.name if frame is not None else ""
        key = (stats.label, reason, location)
        if key not in self.breaks:
            declared = "torch.compiler.disable" in reason and any(name in reason for name in self._declared)
            self.breaks[key] = GraphBreak(stats.label, reason, location, function, declared, step=record.step)
            stats.graph_breaks += 1
            fix = suggest_fix("graph_break", reason)
            event = self._event("graph_break", stats.label, record, first_line(reason), location, fix)
            log.log(
                logging.INFO if declared else logging.WARNING,
                "graph break in region %s at %s: %s%s",
                stats.label,
                location or "?",
                first_line(reason),
                " (declared by an eager rule)" if declared else f". Fix: {event.fix}",
            )
        self.breaks[key].count += 1

    def _failure(
        self, entry: Optional[str], compile_id: str, attempt: int, metric: Any, phase: str, step: Optional[int]
    ) -> None:
        label = self._label(entry)
        stats = self._stats(label)
        reason = str(getattr(metric, "fail_reason", "") or "")
        limit = compat.recompile_limit()
        where = _Where(compile_id, phase, step)
        if compat.is_recompile_limit(reason) or attempt >= limit:
            stats.limit_hits += 1
            guard = guard_text(getattr(metric, "recompile_reason", None)) or "unknown"
            event = self._event("recompile_limit", label, where, guard, fix=recompile_fix(guard, len(stats.modules)))
            log.error(
                "region %s hit recompile_limit=%d: Dynamo now runs it EAGERLY, without the compiled speed-up. "
                "The guard that kept failing: %s. Fix: %s.",
                label,
                limit,
                guard,
                event.fix,
            )
            return
        filename = getattr(metric, "co_filename", None) or ""
        location = f"{filename}:{getattr(metric, 'co_firstlineno', '')}" if filename else ""
        event = self._event(
            "eager_fallback", label, where, first_line(reason), location, suggest_fix("eager_fallback", reason)
        )
        log.warning(
            "region %s: frame %s (%s) fell back to eager: %s. Fix: %s",
            label,
            getattr(metric, "co_name", "?"),
            location,
            first_line(reason),
            event.fix,
        )

    def _check_limit(self, frame: str, attempt: int, stats: RegionStats, reason: str) -> None:
        limit = compat.recompile_limit()
        if attempt >= max(1, limit // 2) and frame not in self._frame_warned and attempt < limit:
            self._frame_warned.add(frame)
            log.warning(
                "region %s has recompiled %d times (recompile_limit=%d; past it the region runs eagerly). "
                "Last guard that failed: %s. Fix: %s.",
                stats.label,
                attempt,
                limit,
                reason,
                recompile_fix(reason, len(stats.modules)),
            )

    def _declared_functions(self) -> List[str]:
        """Qualified names of forwards that `eager` rules disabled inside compiled regions."""
        if self.applied is None or self.root is None:
            return []
        names = set()
        for name in self.applied.eager_inside:
            module = self.root.get_submodule(name)
            names.add(type(module).forward.__qualname__)
        return sorted(names)

    # -- reports ------------------------------------------------------------------------------------

    def graph_breaks(self) -> List[GraphBreak]:
        """Distinct graph breaks; one without a location is dropped when the same break has one."""
        located = {(b.region, b.reason) for b in self.breaks.values() if b.location}
        return [b for b in self.breaks.values() if b.location or (b.region, b.reason) not in located]

    def owner(self, location: str) -> str:
        """The modules whose ``forward`` holds ``location`` (``file:line``), e.g. ``model.blocks.0 (Block)``."""
        if self.root is None or ":" not in location:
            return ""
        filename, _, line_text = location.rpartition(":")
        if not line_text.isdigit():
            return ""
        line, best, names = int(line_text), None, []
        for name, module in self.root.named_modules():
            code = getattr(type(module).forward, "__code__", None)
            if code is None or code.co_filename != filename:
                continue
            lines = [number for _, _, number in code.co_lines() if number is not None]
            if not lines or not (code.co_firstlineno <= line <= max(lines)):
                continue
            span = max(lines) - code.co_firstlineno
            if best is None or span < best:
                best, names = span, [name]
            elif span == best:
                names.append(name)
        if not names:
            return ""
        cls = type(self.root.get_submodule(names[0])).__name__
        shown = names[0] or "<root>"
        return f"{shown} ({cls})" if len(names) == 1 else f"{shown} and {len(names) - 1} more ({cls})"

    def totals(self) -> Dict[str, Any]:
        """The compile headline numbers (stable keys; see docs/telemetry.md)."""
        breaks = self.graph_breaks()
        return {
            "compile_time_s": self.compile_time_s,
            "compiles": sum(s.compiles for s in self.regions.values()),
            "recompiles": sum(s.recompiles for s in self.regions.values()),
            "grad_mode_variants": sum(s.grad_mode_variants for s in self.regions.values()),
            "graph_breaks": sum(1 for b in breaks if not b.declared),
            "declared_graph_breaks": sum(1 for b in breaks if b.declared),
            "unique_graphs": self.unique_graphs,
            "recompile_limit_hits": sum(s.limit_hits for s in self.regions.values()),
            "eager_fallbacks": sum(1 for e in self.events if e.kind == "eager_fallback"),
            "cudagraph_skips": sum(s.cudagraph_skips for s in self.regions.values()) + self.runtime_cudagraph_skips,
        }

    def region_rows(self) -> List[Dict[str, Any]]:
        return [asdict(stats) for stats in self.regions.values()]

    def format_report(self) -> str:
        """Regions, graph breaks and recompiles as fixed-width text."""
        lines = ["compile telemetry"]
        header = (
            "region",
            "modules",
            "compiles",
            "recompiles",
            "grad-mode variants",
            "graphs",
            "breaks",
            "compile s",
            "of it recompiles",
            "cache hit/miss",
        )
        rows = [
            (
                s.label,
                str(len(s.modules)) if s.modules else "-",
                str(s.compiles),
                str(s.recompiles),
                str(s.grad_mode_variants),
                str(s.graphs),
                str(s.graph_breaks),
                f"{s.compile_time_s:.2f}",
                f"{s.recompile_time_s:.2f}",
                f"{s.cache_hits}/{s.cache_misses}",
            )
            for s in self.regions.values()
        ]
        lines += text_table(header, rows)
        breaks = self.graph_breaks()
        lines.append(f"graph breaks: {len(breaks)}")
        for item in breaks:
            owner = self.owner(item.location)
            tag = " [declared: eager rule]" if item.declared else ""
            lines.append(f"  - {item.location or '?'} in {item.function or '?'}{tag}")
            lines.append(f"    region {item.region}" + (f", module {owner}" if owner else ""))
            lines.append(f"    reason: {item.short_reason}")
            if not item.declared:
                lines.append(f"    fix: {suggest_fix('graph_break', item.reason)}")
        others = [e for e in self.events if e.kind != "graph_break"]
        if others:
            lines.append(f"recompiles and fallbacks: {len(others)}")
            for event in others:
                when = f"{event.phase} step {event.step}" if event.step is not None else event.phase
                lines.append(f"  - {event.kind} of {event.region} ({event.compile_id}, {when}): {event.reason}")
                lines.append(f"    fix: {event.fix}")
        return "\n".join(lines)


@dataclass
class _Where:
    compile_id: str
    phase: str
    step: Optional[int]
