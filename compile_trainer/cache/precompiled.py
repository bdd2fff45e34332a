"""The ``precompiled`` bundle layer: each region's Dynamo trace with its compiled code, serialized.

Why: with the other layers a new machine's compiles are cache hits for the backend, but Dynamo still traces every
region again, most of the first step (docs/compile_cache.md). ``torch.compile(...).aot_compile`` serializes the
trace, its guards and the backend's code together (``compat.aot_compile``).

Capture (a run that writes bundles): when a region's call compiled something, a copy of its inputs is kept with
its grad mode, autocast state and modules' training flags; at the end of training (``capture_pending``, the
callback's fit end) each is traced once more by ``aot_compile`` under that state, and serialized. Regions with a
graph break are left out (``skipped``). Not during training: an ``aot_compile`` between a region's compile and its
CUDA-graph recording made the recording fail (cudaErrorStreamCaptureInvalidated; H100, torch 2.11, regional
GPT-2). The capture lowers the graphs with Inductor again (its FX graph cache is off for serializable compiles;
Triton's binaries are cache hits): in the order of a cold compile's backend time, paid once per bundle.

Serve (a run that loaded a bundle): from ``attach`` on, a thread loads every artifact of the policy's entries
captured on this process's device, under the state it was captured in (their guards are rebuilt from the state at
load; unpickling a whole-model artifact's guards and loading its kernels took 0.6 s of a new machine's first step
under ``full``, GPT-2 small, H200), while Lightning sets up and the first batch is fetched. At a region's first
call in a grad-mode/autocast state, the artifacts captured in that state (loaded by then, or now) serve every call
their guards accept; any other call goes to the region's normal compile, as without the layer. An artifact whose
model code changed since it was captured (the sources Dynamo traced, torch's own excepted: its version is in the
bundle's key) is never used.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map

from compile_trainer import compat
from compile_trainer.cache.bundle import BundleError, CompileCacheWarning, decode, encode
from compile_trainer.compiling.arguments import kwargs_use_cuda_graphs
from compile_trainer.compiling.region_call import PRECOMPILED
from compile_trainer.compiling.regions import CompiledRegion
from compile_trainer.compiling.thread_guards import forks_wait

log = logging.getLogger(__name__)

SECTION = "precompiled"
AUTOCAST_DEVICES = ("cpu", "cuda")


GlobalState = Tuple[bool, bool, Tuple[Tuple[str, bool, str], ...], bool, str]


def current_state() -> GlobalState:
    """The global state a loaded artifact's guards are built from: grad mode, inference mode, autocast per device
    and autocast's weight cache (Lightning's mixed-precision plugins turn it off: a guard of its own); and the
    current CUDA device, since the guards check each tensor's device index: a capture on cuda:0 never serves
    rank 1's cuda:1, so each rank's are kept apart."""
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in AUTOCAST_DEVICES)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else ""
    cache_enabled = torch.is_autocast_cache_enabled()
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, cache_enabled, device


@contextlib.contextmanager
def _entered(state: GlobalState) -> Iterator[None]:
    """``state`` for the duration: the grad and inference modes, autocast on or off per device, its cache (the
    device is the capturing rank's own)."""
    grad, inference, autocast, cache_enabled, _ = state
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.callback(torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled())
        torch.set_autocast_cache_enabled(cache_enabled)
        for device, enabled, dtype in autocast:
            if enabled:
                dtype = getattr(torch, dtype.removeprefix("torch."))
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache_enabled))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def _attribute_set(name: str, values: List[Tuple[Any, Any]]) -> Iterator[None]:
    """Each object's attribute ``name`` set to its value for the duration, then put back."""
    before = [(target, getattr(target, name)) for target, _ in values]
    for target, value in values:
        setattr(target, name, value)
    try:
        yield
    finally:
        for target, value in before:
            setattr(target, name, value)


def _gradients_set_aside(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The parameters' ``.grad`` set to None for the duration.

    The serialized guards keep each parameter with its ``.grad``; a gradient outside the guards is written as a
    placeholder that torch then fails to load ("assigned grad expected to be a Tensor or None", torch 2.13 under
    DDP, whose parameters hold their gradients at the next forward). The trace does not read them.
    """
    return _attribute_set("grad", [(p, None) for p in module.parameters() if p.grad is not None])


def _input_copy(value: torch.Tensor) -> torch.Tensor:
    """A tensor's detached copy with its strides (guarded: a slice's too), ``requires_grad`` and dynamic-shape
    marks."""
    copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    copy = copy.copy_(value.detach()).requires_grad_(value.requires_grad)
    return compat.copy_dynamo_marks(value, copy)


def _inputs_copied(inputs: Any) -> Any:
    """``inputs`` with each tensor copied (``_input_copy``) once: a tensor passed twice (HF's ``input_ids`` as its
    ``labels``) stays one, since Dynamo guards that inputs it saw apart are not the same tensor."""
    copies: Dict[int, torch.Tensor] = {}

    def copied(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in copies:
            copies[id(value)] = _input_copy(value)
        return copies[id(value)]

    return tree_map(copied, inputs)


@dataclass
class PendingCapture:
    """A region call that compiled, kept until ``capture_pending`` traces it for the bundle."""

    item: CompiledRegion
    state: GlobalState
    training: List[Tuple[torch.nn.Module, bool]]
    args: Tuple
    kwargs: Dict[str, Any]


def _torch_source(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


@dataclass
class Artifact:
    entry_key: str  # CompiledRegion.entry_key: the compiled entry it serves
    region: str  # the region whose call captured it
    state: str  # repr(current_state()) at capture
    data: bytes
    function: Optional[Any] = None  # loaded (compat.load_aot_compiled)


def encode_section(artifacts: List[Artifact], uncapturable: Dict[str, str]) -> bytes:
    """The layer's bundle section: the artifacts, and the entries whose capture failed (entry key -> why)."""
    listed = [{"entry_key": a.entry_key, "region": a.region, "state": a.state} for a in artifacts]
    manifest = {"artifacts": listed, "uncapturable": uncapturable}
    return encode(manifest, {str(index): a.data for index, a in enumerate(artifacts)})


def decode_section(data: bytes) -> Tuple[List[Artifact], Dict[str, str]]:
    section = decode(data)
    try:
        listed = section.manifest["artifacts"]
        artifacts = [Artifact(**fields, data=section.sections[str(i)]) for i, fields in enumerate(listed)]
        return artifacts, dict(section.manifest["uncapturable"])
    except (KeyError, TypeError, ValueError) as error:
        raise BundleError(f"corrupt precompiled section ({type(error).__name__}: {error})") from error


class PrecompiledRegions:
    """An interceptor (``region_call``): serves region calls from loaded artifacts, captures new compiles."""

    position = PRECOMPILED
    replaces_compiled = False  # what it serves is the region's compiled code (CUDA graphs need the step marks)

    def __init__(self, loaded: List[Artifact], capture: bool, uncapturable: Optional[Dict[str, str]] = None):
        self.loaded = loaded  # from the bundle; served once loaded (dropped when they cannot be)
        self.captured: List[Artifact] = []  # this run's: saved, not served (the run has its compiled code)
        self.capture = capture
        self.hits: Counter = Counter()  # region -> calls served by a loaded artifact
        self.misses: Counter = Counter()  # region -> calls that compiled (Dynamo traced) instead
        self.skipped: Dict[str, str] = {}  # region -> why it is not captured or its artifacts not used
        # entry key -> why its capture failed (in this run or the bundle's): not tried again, its calls not kept
        self.uncapturable: Dict[str, str] = dict(uncapturable or {})
        self.capture_s, self.load_s = 0.0, 0.0  # load_s: what region calls spent loading, or waiting for the thread
        self.background_load_s = 0.0  # the loading thread's own time (load_in_background)
        self._loading: Optional[threading.Thread] = None
        self._failed_loads: List[Tuple[Artifact, str, str]] = []  # (artifact, region, why): the thread's, to drop
        self.loads = 0  # (entry, state) pairs whose artifacts were loaded: a step that loads is no steady step
        self.pending: List[PendingCapture] = []
        self._ready: Dict[Tuple[str, GlobalState], List[Artifact]] = {}  # (entry_key, state) -> loaded artifacts
        self._written = (0, len(self.uncapturable))  # (captures, uncapturable entries) at the last save

    def __call__(self, item: CompiledRegion, proceed: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        module = item.region.module
        for artifact in self._loaded(item):
            if artifact.function.guard_check(module, *args, **kwargs):
                self.hits[item.region.name] += 1
                item.calls += 1
                return artifact.function.fn(module, *args, **kwargs)
        graphs = compat.unique_graphs()
        result = proceed(*args, **kwargs)
        if compat.unique_graphs() != graphs:
            self.misses[item.region.name] += 1
            if item.entry_key in self.uncapturable:
                self.skipped[item.region.name] = f"{self.uncapturable[item.entry_key]} (an earlier capture)"
            elif self.capture:
                self._keep(item, args, kwargs)
        return result

    def _keep(self, item: CompiledRegion, args: Tuple, kwargs: Dict[str, Any]) -> None:
        training = [(module, module.training) for module in item.region.module.modules()]
        args, kwargs = _inputs_copied((args, kwargs))
        self.pending.append(PendingCapture(item, current_state(), training, args, kwargs))

    def capture_pending(self) -> None:
        """Trace and serialize the region calls that compiled since the last time (call after training)."""
        pending, self.pending = self.pending, []
        for call in pending:
            if call.item.entry_key not in self.uncapturable:
                self._capture(call)

    def load_in_background(self, items: Iterable[CompiledRegion]) -> None:
        """Load the artifacts of ``items``' entries captured on this process's device (a bundle holds every rank's)
        on a thread, each under the state it was captured in, so that region calls find them loaded; the first call
        that needs one waits for the thread."""
        by_entry, device = {item.entry_key: item for item in items}, current_state()[-1]
        work = [
            (artifact, by_entry[artifact.entry_key], state)
            for artifact in self.loaded
            if artifact.entry_key in by_entry and (state := ast.literal_eval(artifact.state))[-1] == device
        ]  # the state: repr(current_state()), literals only
        if work:
            args = (work, device)
            self._loading = threading.Thread(target=self._load_all, args=args, name="precompiled-load", daemon=True)
            self._loading.start()

    def _load_all(self, work: List[Tuple[Artifact, CompiledRegion, GlobalState]], device: str) -> None:
        started = time.perf_counter()
        if device:  # this process's CUDA device: the thread's kernels load there
            torch.cuda.set_device(device)
        for artifact, item, state in work:
            # A fork (a DataLoader's workers) waits for the artifact: loading starts subprocesses (Inductor's
            # compile-worker pool, on a new machine), and a fork beside that start hung this thread (thread_guards)
            with forks_wait(), _entered(state):
                why = self._load(artifact, item)
            if why is not None:
                self._failed_loads.append((artifact, item.region.name, why))
        self.background_load_s = time.perf_counter() - started

    def _wait_for_loading(self) -> None:
        """Join the loading thread; the artifacts it could not load are dropped here, on the training thread."""
        if self._loading is not None:
            self._loading.join()
            self._loading = None
            for artifact, region, why in self._failed_loads:
                self._drop(artifact, region, why)

    def _loaded(self, item: CompiledRegion) -> List[Artifact]:
        if not self.loaded:
            return []
        key = (item.entry_key, current_state())  # every call: the tuple, its repr only when artifacts are loaded
        if key not in self._ready:
            started = time.perf_counter()  # loaded by the thread, else now under the state they will be checked in
            self._wait_for_loading()
            wanted = (item.entry_key, repr(key[1]))
            matching = [a for a in self.loaded if (a.entry_key, a.state) == wanted]
            self._ready[key] = [a for a in matching if self._usable(a, item)]
            self.load_s += time.perf_counter() - started
            self.loads += bool(self._ready[key])
        return self._ready[key]

    def _load(self, artifact: Artifact, item: CompiledRegion) -> Optional[str]:
        """Load ``artifact`` (sets its ``function``); why it cannot be used, or None."""
        try:
            cudagraphs = kwargs_use_cuda_graphs(item.compile_kwargs)
            function = compat.load_aot_compiled(artifact.data, item.entry.__globals__, cudagraphs=cudagraphs)
            changed = compat.aot_changed_sources(function, skip=_torch_source)
            if changed:
                raise BundleError(f"the model's code changed since it was compiled: {', '.join(changed)}")
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        artifact.function = function
        return None

    def _usable(self, artifact: Artifact, item: CompiledRegion) -> bool:
        """Loaded already, or now; one that cannot be used is dropped (``_drop``)."""
        why = None if artifact.function is not None else self._load(artifact, item)
        if why is not None:
            self._drop(artifact, item.region.name, why)
        return why is None

    def _drop(self, artifact: Artifact, region: str, why: str) -> None:
        """Never served nor saved again; a warning (on the training thread) says why."""
        self.loaded.remove(artifact)
        self.skipped[region] = why
        warnings.warn(
            f"compile cache: precompiled {region!r} not used ({why}); it compiles as without the layer",
            CompileCacheWarning,
            stacklevel=3,
        )

    def _capture(self, call: PendingCapture) -> None:
        item, started = call.item, time.perf_counter()
        try:
            module = item.region.module
            with _entered(call.state), _attribute_set("training", call.training), _gradients_set_aside(module):
                function = compat.aot_compile(item.entry, item.compile_kwargs, (module, *call.args), call.kwargs)
            data = compat.serialize_aot_compiled(function)
        except Exception as error:  # a graph break, a backend that cannot serialize: compiled as usual
            self.skipped[item.region.name] = self.uncapturable[item.entry_key] = compat.traced_error_summary(error)
            log.info("compile cache: %s not precompiled (%s)", item.region.name, self.skipped[item.region.name])
            return
        finally:
            self.capture_s += time.perf_counter() - started
        self.captured.append(Artifact(item.entry_key, item.region.name, repr(call.state), data))

    def add_captured(self, artifacts: List[Artifact], uncapturable: Dict[str, str]) -> None:
        """Other ranks' captures (rank 0 writes the bundle): those of an entry and state not held yet."""
        held = {(a.entry_key, a.state) for a in self.artifacts}
        self.captured += [a for a in artifacts if (a.entry_key, a.state) not in held]
        self.uncapturable |= uncapturable

    @property
    def artifacts(self) -> List[Artifact]:
        """What the next bundle carries: the loaded artifacts still usable, and this run's captures."""
        return self.loaded + self.captured

    @property
    def changed_since_save(self) -> bool:
        """New captures, or new entries that cannot be captured, to write."""
        return (len(self.captured), len(self.uncapturable)) != self._written

    def section(self) -> Optional[bytes]:
        """Every usable artifact (loaded or captured) as the bundle's section; None when there is none."""
        self._wait_for_loading()  # an artifact the thread cannot load is not written again
        self._written = len(self.captured), len(self.uncapturable)
        if not (self.artifacts or self.uncapturable):
            return None
        return encode_section(self.artifacts, self.uncapturable)

    def summary(self) -> Dict[str, Any]:
        return {
            "cache_precompiled_hits": sum(self.hits.values()),
            "cache_precompiled_misses": sum(self.misses.values()),
            "cache_precompiled_artifacts": len(self.artifacts),
            "cache_precompiled_captures": len(self.captured),
            "cache_precompiled_capture_s": self.capture_s,
            "cache_precompiled_load_s": self.load_s,
            "cache_precompiled_background_load_s": self.background_load_s,
            "cache_precompiled_regions": {
                name: {"hits": self.hits[name], "misses": self.misses[name]} for name in self.hits | self.misses
            },
            "cache_precompiled_skipped": dict(self.skipped) or None,
        }
