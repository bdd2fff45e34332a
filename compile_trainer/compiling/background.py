"""Compiling in the background: the first steps run eagerly while a thread compiles the regions.

A cold compile of a large model costs tens of seconds before the first step; compiling less (regional
compilation) only shortens it. Compiling on a thread hides it instead: the first step runs eagerly and
records each region's inputs, a thread then compiles every region by calling it with copies of them
(the forward graph and, eagerly, the backward graph), training goes on eagerly meanwhile, and at the first
step boundary after the thread is done the compiled regions take over.

The thread's call compiles but does not run the compiled graph (``compile_trainer.backends``): nothing
runs on the GPU from that thread, no random numbers are drawn, no activations are held. It calls a shadow
of the region (its own module objects, buffers, and parameters aliasing the same memory), so that nothing the
training thread does meanwhile (``model.eval()`` for validation, a backward) changes what is traced or is
touched by the trace. It creates the Dynamo
cache entry that the real calls then hit: the same code object and backend, and guards that pass because
the grad mode, autocast state and input metadata are the recorded ones. Kernel autotuning and, with CUDA
graphs, warm-up and recording happen at the first compiled step, on the training thread. The compilers'
save-and-restore of the process-wide random-number state is skipped on the thread (it would rewind the
training thread's generators); the step at which the compiled regions take over varies from run to run.

The thread holds the GIL while it traces, and each torch op of an eager step waits for it (a step of seconds where
alone it takes tens of milliseconds). With Inductor, ``background_lowering: subprocess`` (what ``auto`` takes under
``background: true``; ``CompilePolicy.lowering``) lowers each graph in Inductor's compile subprocess
(``compat.lowering_in_subprocess``): the thread waits for it without the GIL.

Without Lightning::

    applied = apply_policy(model, policy)
    background = BackgroundCompile(applied)  # from here the regions run eagerly until compiled
    for batch in loader:
        background.poll()  # starts the compile after the first step, installs it when it is ready
        train_step(batch)
    background.close()
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from compile_trainer import compat
from compile_trainer.compiling.backends import CompiledNotRun, compile_only
from compile_trainer.compiling.region_call import BACKGROUND
from compile_trainer.compiling.regions import AppliedPolicy, CompiledRegion
from compile_trainer.compiling.runtime_checks import background_compile_problem


class BackgroundCompileError(RuntimeError):
    """A region failed to compile on the background thread."""


def shadow_module(module: nn.Module, aliases: Optional[Dict[int, nn.Parameter]] = None) -> nn.Module:
    """A copy of ``module`` whose parameters alias the originals' memory and owns copies of its buffers
    (recursively).

    The aliases are parameters of their own (tied weights stay tied), so that the thread never touches the
    autograd state of the parameters being trained: tracing reads each parameter's ``.grad`` to make its fake
    tensor, while the training thread's backward and ``zero_grad`` set and clear the originals' (unsynchronized
    in C++; a test worker crashed in a background compile).
    """
    aliases = {} if aliases is None else aliases
    for parameter in module._parameters.values():
        if parameter is not None and id(parameter) not in aliases:
            aliases[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad)
    # not copy.copy: it calls the class's __new__, and FSDP2's module classes construct the original class anew there
    shadow = object.__new__(type(module))
    shadow.__dict__.update(module.__dict__)
    shadow.__dict__["_parameters"] = {k: None if p is None else aliases[id(p)] for k, p in module._parameters.items()}
    shadow.__dict__["_buffers"] = {k: None if b is None else b.detach().clone() for k, b in module._buffers.items()}
    shadow.__dict__["_modules"] = {
        k: None if m is None else shadow_module(m, aliases) for k, m in module._modules.items()
    }
    return shadow


def _copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (a slice of a batch is not contiguous: Dynamo guards on strides),
    ``requires_grad``, and Dynamo's shape marks (``mark_dynamic`` sets attributes on the tensor object)."""
    copied = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    copied.copy_(tensor.detach()).requires_grad_(tensor.requires_grad)
    return compat.copy_dynamo_marks(tensor, copied)


@dataclass
class RecordedCall:
    """One call of a region, as the background thread replays it."""

    module: nn.Module  # a shadow of the region
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    grad_enabled: bool
    autocast: Dict[str, Tuple[bool, torch.dtype]]  # device type -> (enabled, dtype)
    autocast_cache: bool  # Dynamo guards on it too (Lightning's mixed precision turns it off)
    device: Optional[torch.device]

    @classmethod
    def record(cls, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> RecordedCall:
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        device_types = {"cpu"} | {t.device.type for t in tensors}
        cuda = next((t for t in tensors if t.device.type == "cuda"), None)
        return cls(
            module=shadow_module(module),
            args=tree_map_only(torch.Tensor, _copy_tensor, args),
            kwargs=tree_map_only(torch.Tensor, _copy_tensor, kwargs),
            grad_enabled=torch.is_grad_enabled(),
            autocast={t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(device_types)},
            autocast_cache=torch.is_autocast_cache_enabled(),
            device=cuda.device if cuda is not None else None,
        )

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The grad mode and autocast state of the recorded call (thread-local state, so set per thread):
        Dynamo guards on them, and a difference would recompile at the first compiled step."""
        with contextlib.ExitStack() as stack:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, (enabled, dtype) in self.autocast.items():
                if enabled:  # a new thread starts with autocast off
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            cache = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(self.autocast_cache)
            stack.callback(torch.set_autocast_cache_enabled, cache)
            yield

    def replay(
        self, item: CompiledRegion, args: Optional[Tuple[Any, ...]] = None, kwargs: Optional[Dict[str, Any]] = None
    ) -> None:
        """Compile ``item`` by calling its entry on the shadow, up to where its first graph would run; with the
        recorded inputs, or ``args``/``kwargs`` in their place (bucket warm-up: resized to another length).

        A region with graph breaks gets its first graph compiled here, the rest at their first real call.
        """
        compiled = item.compile_on(self.module)
        with self.context(), compile_only(), contextlib.suppress(CompiledNotRun):
            compiled(*(self.args if args is None else args), **(self.kwargs if kwargs is None else kwargs))


class BackgroundCompile:
    """Defers ``applied``'s compiled regions: they run eagerly until a background thread has compiled them. Under
    ``rest: background`` (and not ``background: true``) only ``applied.background_parts`` are deferred (the parts
    around the blocks, and blocks whose structure no other shares); the shared blocks compile in place at their
    first call, as usual.

    Each region's first training call (grad on) is recorded; evaluation graphs compile at their first call
    after the switch, as usual (compiling them on the thread too made the training graph wait for them:
    54 s instead of about 32 s for GPT-2 small on an H100, behind Lightning's sanity check). Call ``poll()``
    at every step boundary (before the step): once a call is recorded it starts the thread; once the
    thread is done it installs the compiled regions (or raises ``BackgroundCompileError`` naming the
    region that failed). ``close()`` waits for a running thread.
    """

    def __init__(self, applied: AppliedPolicy):
        self.lowering = applied.background_lowering
        problem = background_compile_problem(self.lowering)
        if problem:
            raise RuntimeError(f"background compile {problem}")
        self.applied = applied
        self.defers_every_region = applied.policy.background or not applied.background_parts
        self.lowerings = compat.SubprocessLowerings()
        # entry name -> its first training call; blocks of one class share an entry, and one graph
        self.recorded: Dict[str, Tuple[CompiledRegion, RecordedCall]] = {}
        self.state = "recording"  # -> "compiling" -> "installed"
        self.eager_steps = 0
        self.compile_seconds: Optional[float] = None
        self.compiled_after_seconds: Optional[float] = None  # from the first poll to the install
        self._first_poll: Optional[float] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()  # set: the thread compiles no further region
        self.regions_compiled = 0  # entries the thread compiled (of ``len(self.recorded)``)
        self._failure: Optional[Tuple[str, BaseException]] = None
        self._recorder = _RecordAndRunEagerly(self)
        applied.interceptors.add(self._recorder)
        if applied.uses_inductor:  # ready by the time the thread lowers its first graph
            compat.warm_compile_workers()
            if self.lowering == "subprocess":
                compat.warm_subprocess_lowering()

    @property
    def installed(self) -> bool:
        return self.state == "installed"

    @property
    def disturbs_steps(self) -> bool:
        """Whether a training step now is no steady state: every region runs eagerly until the install
        (``background: true``), or the thread's compile competes with the step for the interpreter (under
        ``rest: background`` too: the recipe's GPT-2 small on an H200 ran 73-86 ms a step beside it, 19 ms after)."""
        return self.state == "compiling" or (not self.installed and self.defers_every_region)

    def poll(self) -> bool:
        """Start or finish the background compile as far as it can go now; True once installed."""
        now = time.perf_counter()
        if self._first_poll is None:
            self._first_poll = now
        if self.state == "recording" and self.recorded:
            self.state = "compiling"
            if self.applied.uses_cuda_graphs:
                # CUDA graph trees create their per-thread state on the thread that imports them; the
                # training thread runs the graphs, and torch 2.11 fails on a thread without that state.
                compat.import_cudagraph_trees()
            self._thread = threading.Thread(target=self._compile, name="compile_trainer-background", daemon=True)
            self._thread.start()
        elif self.state == "compiling" and not self._thread.is_alive():
            self._install(now)
        if not self.installed:
            self.eager_steps += 1
        return self.installed

    def wait(self) -> None:
        """Block until the background compile is done, and install it."""
        if self.state == "compiling":
            self._thread.join()
            self._install(time.perf_counter())

    def stop_after_region(self) -> None:
        """Have the thread compile no region after the one it is compiling (a compile cannot be interrupted)."""
        self._stop.set()

    def close(self, finish: bool = True) -> None:
        """End of training: wait for a running compile, then install it. ``finish=False``: the thread stops after
        the region it is compiling; the regions it did not reach compile at their first call, if they run again
        (``CompileCallback``: a fit that ends before the compile does waits seconds, not the whole compile)."""
        if self.state == "recording":  # never started: nothing was recorded, compile lazily as usual
            self._stop_running_eagerly()
            self.state = "installed"
        if not finish:
            self.stop_after_region()
        self.wait()

    def describe(self) -> str:
        if self.compile_seconds is None:
            return f"background compile: {self.state}, {self.eager_steps} eager steps so far"
        lowered = ""
        if self.lowering == "subprocess":
            here = ", ".join(f"{n} on the thread: {reason}" for reason, n in self.lowerings.here.items())
            lowered = f" ({self.lowerings.in_subprocess} graphs lowered in a subprocess{', ' + here if here else ''})"
        regions, left = len(self.recorded), len(self.recorded) - self.regions_compiled
        stopped = f" (stopped at the end of training: {left} compile at their first call)" if left else ""
        return (
            f"background compile: {self.regions_compiled} of {regions} regions in {self.compile_seconds:.1f} s on a "
            f"thread{lowered}{stopped}, while {self.eager_steps} steps ran eagerly; compiled regions in use "
            f"{self.compiled_after_seconds:.1f} s after the first step started"
        )

    def summary(self) -> Dict[str, Any]:
        return {
            "background_compile_s": self.compile_seconds,
            "background_regions": len(self.recorded),
            "background_regions_compiled": self.regions_compiled,
            "background_eager_steps": self.eager_steps,
            "background_compiled_after_s": self.compiled_after_seconds,
            "background_lowering": self.lowering,
            "background_graphs_lowered_in_subprocess": self.lowerings.in_subprocess,
            "background_graphs_lowered_on_thread": sum(self.lowerings.here.values()),
            "background_lowered_on_thread_because": dict(self.lowerings.here),
        }

    def _compile(self) -> None:
        started = time.perf_counter()
        name = "?"
        try:
            # Compile backward graphs now, on this thread: lazily, they would compile inside the first real
            # backward, on the autograd engine's thread, stalling training for seconds.
            lowering = (
                compat.lowering_in_subprocess(self.lowerings)
                if self.lowering == "subprocess"
                else contextlib.nullcontext()
            )
            with compat.eager_backward_lowering(), lowering:
                for item, recorded in self.recorded.values():
                    if self._stop.is_set():
                        break
                    name = item.region.name
                    recorded.replay(item)
                    self.regions_compiled += 1
                    recorded.module, recorded.args, recorded.kwargs = None, (), {}  # free the copies
        except BaseException as error:  # noqa: BLE001 - reported on the training thread by poll()
            self._failure = (name, error)
        self.compile_seconds = time.perf_counter() - started

    def _install(self, now: float) -> None:
        if self._failure is not None:
            name, error = self._failure
            self._failure = None
            self.state = "failed"
            raise BackgroundCompileError(
                f"background compile of region {name!r} failed ({compat.traced_error_summary(error)}); the model "
                "ran eagerly until now. Compile it in the foreground (background: false) to debug."
            ) from error
        self._stop_running_eagerly()
        self.state = "installed"
        self.compiled_after_seconds = now - (self._first_poll or now)
        for _, recorded in self.recorded.values():  # those the thread did not reach
            recorded.module, recorded.args, recorded.kwargs = None, (), {}

    def _stop_running_eagerly(self) -> None:
        self.applied.interceptors.remove(self._recorder)


class _RecordAndRunEagerly:
    """The background compile's interceptor: records each deferred entry's first training call, runs deferred
    regions eagerly; the others run compiled."""

    position = BACKGROUND

    def __init__(self, background: BackgroundCompile):
        self.background = background
        self.replaces_compiled = background.defers_every_region  # else the blocks run compiled meanwhile

    def __call__(self, item: CompiledRegion, proceed: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not (self.background.defers_every_region or item.region.background):
            return proceed(*args, **kwargs)
        module, background = item.region.module, self.background
        training = module.training and torch.is_grad_enabled()
        if background.state == "recording" and training and item.entry_name not in background.recorded:
            background.recorded[item.entry_name] = (item, RecordedCall.record(module, args, kwargs))
        return compat.call_uncompiled(module, *args, **kwargs)
