"""Keeping a compile thread's process-wide side effects off the training thread.

The compilers change process-wide state while they work, as if nothing else ran meanwhile:

- Dynamo, AOTAutograd and Inductor save the random-number state (torch's CPU and CUDA generators, Python's
  ``random``) before they compile and restore it after, to undo draws made while tracing. On a second thread
  that restore rewinds the training thread's generators: draws it made meanwhile (dropout masks) come again.
- FX's tracer replaces ``torch.nn.Module.__call__`` and ``__getattr__`` while it traces (Inductor traces its
  pattern-matching rules so, for one). A module called on another thread meanwhile goes through the tracer:
  "module is not installed as a submodule" killed a training step beside a background compile of GPT-2 small
  on an H100.
- FX's tracer (AOTAutograd's, too) sets one process-wide flag while it traces, and a function ``torch.compile``
  returned refuses to run while it is set ("FX to symbolically trace a dynamo-optimized function"): a block
  compiled in place, called on the training thread while a thread compiles the parts around it
  (``rest: background``), failed so. ``blind_to_guarded_tracing()`` wraps the regions' ``torch.compile`` calls
  so that their functions skip that check while a guarded thread runs.
- Dynamo holds ``torch.compiler.is_compiling()``'s flag true for a whole compile (torch 2.13), for every thread:
  eager code on the training thread then takes its compiled-code branches meanwhile. Collectives refuse to run
  (``self.all_gather(..., sync_grads=True)`` under DDP: "torch.distributed.nn.functional.all_gather is not
  supported under torch.compile"), and ``torch.optim`` takes its compiled-code paths.
- The compilers start subprocesses (Inductor's compile workers and compile subprocess, the C++ compiler), while
  the training thread forks (a DataLoader's workers). A fork while another thread's ``Popen`` starts its child
  copies the pipes that ``Popen`` waits on into the forked process, and ``Popen`` then waits until that process
  exits: a thread loading the compile cache's artifacts blocked until the run was killed in 4 of 6 runs (GPU,
  torch 2.11); a guarded thread compiling four small functions with Inductor while the main thread forked a
  process living 2 s every 10 ms had 6-8 of its 29 subprocess starts wait 2 s (36-38 s in all; 21-24 s with
  forks waiting; two CPU cores, torch 2.13, 2026-11-27).

Inside ``guarded_thread()`` all five are confined to the thread: its random-number restores do nothing (a thread
that compiles without running has drawn nothing to undo), FX's method patches made on it apply to it alone,
its compiles leave the compiling flag alone, and a fork waits while any thread starts a subprocess (a few
milliseconds: until the child has exec'd). The code Dynamo traces on it is unchanged (Dynamo folds the
``is_compiling()`` calls it traces to True without reading the flag); code that the compilers run outside the
trace on that thread (a tensor subclass's dispatch under AOTAutograd) sees False, as on torch before 2.13.
While any guarded thread runs, the functions involved are replaced with thread-aware ones that let every other
thread through to the originals; the originals come back when the last guarded thread leaves. Dynamo runs those
replacements as plain Python: compiled code on the training thread that calls one (a module called past an outer
region's break while the thread's FX trace has ``nn.Module.__call__`` replaced) would otherwise have Dynamo compile
it, and count a graph break at the FX wrapper it calls (T5-base beside a background compile, H100, torch 2.11).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import subprocess
import threading
from typing import Any, Callable, Dict, Iterator, Set, Tuple

import torch

from compile_trainer import compat

_lock = threading.Lock()
_guarded: Set[int] = set()  # thread idents
_originals: Dict[Tuple[Any, str], Callable[..., Any]] = {}  # while replaced


def _skipped_on_guarded_threads(restore: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(restore)
    def restore_unless_guarded(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in _guarded:
            return restore(*args, **kwargs)
        return None

    return restore_unless_guarded


def _method_patches_confined_to_guarded_threads(patch_method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(patch_method)
    def confined_patch_method(patcher: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate=True):
        owner = threading.get_ident()
        if owner in _guarded:
            tracing, others = new_fn, getattr(cls, name)

            @functools.wraps(tracing)
            def on_the_tracing_thread_only(*args: Any, **kwargs: Any) -> Any:
                return (tracing if threading.get_ident() == owner else others)(*args, **kwargs)

            new_fn = compat.run_as_plain_python(on_the_tracing_thread_only)
        return patch_method(patcher, cls, name, new_fn, deduplicate)

    return confined_patch_method


def _compiling_flag_left_alone_on_guarded_threads(session: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(session)
    def session_unless_guarded(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in _guarded:
            return session(*args, **kwargs)
        return contextlib.nullcontext()

    return session_unless_guarded


# Held while a fork of this process must wait: a subprocess starting (any thread's, while a guarded thread runs),
# or a block of ``forks_wait()``
_forks_waiting = threading.RLock()


@functools.cache  # the fork hooks, once per process (they cannot be removed); a no-op while nothing holds the lock
def _forks_wait_for_the_lock() -> None:
    lock = _forks_waiting
    os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)


@contextlib.contextmanager
def forks_wait() -> Iterator[None]:
    """A fork of this process (from any thread) waits until the block ends."""
    _forks_wait_for_the_lock()
    with _forks_waiting:
        yield


def _started_before_any_fork(execute_child: Callable[..., Any]) -> Callable[..., Any]:
    _forks_wait_for_the_lock()

    @functools.wraps(execute_child)
    def execute_child_before_forks(*args: Any, **kwargs: Any) -> Any:
        with _forks_waiting:  # from the pipes' creation to the child's exec, which closes them there
            return execute_child(*args, **kwargs)

    return execute_child_before_forks


# (owner, attribute) -> how to make the thread-aware replacement of the original
REPLACEMENTS: Dict[Tuple[Any, str], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    (torch.random, "set_rng_state"): _skipped_on_guarded_threads,
    (torch.cuda, "set_rng_state"): _skipped_on_guarded_threads,
    (random, "setstate"): _skipped_on_guarded_threads,
    (compat.fx_patcher(), "patch_method"): _method_patches_confined_to_guarded_threads,
}
if hasattr(os, "register_at_fork"):  # POSIX: where a process forks
    REPLACEMENTS[(subprocess.Popen, "_execute_child")] = _started_before_any_fork
if compat.compile_session_owner() is not None:
    REPLACEMENTS[compat.compile_session_owner()] = _compiling_flag_left_alone_on_guarded_threads


def _fx_tracing_unless_a_guarded_thread_runs(original: Callable[[], bool]) -> Callable[[], bool]:
    @functools.wraps(original)
    def fx_tracing_here() -> bool:
        # Not thread-aware in general: one flag for the process, and nobody knows which thread set it. While a
        # guarded thread runs, it is the compile's; nothing FX-traces the regions on the training thread.
        return not _guarded and original()

    return compat.run_as_plain_python(fx_tracing_here)


@contextlib.contextmanager
def blind_to_guarded_tracing() -> Iterator[None]:
    """Around ``torch.compile(...)``: the function it returns does not see a guarded thread's FX tracing (nothing to
    do where the flag is per thread)."""
    check = compat.fx_tracing_check()
    if check is None:
        yield
        return
    owner, name = check
    original = getattr(owner, name)
    setattr(owner, name, _fx_tracing_unless_a_guarded_thread_runs(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def guarded_thread() -> Iterator[None]:
    """Confine the compilers' process-wide side effects made on this thread to this thread."""
    ident = threading.get_ident()
    with _lock:
        nested = ident in _guarded
        if not _guarded:
            for (owner, name), replace in REPLACEMENTS.items():
                _originals[(owner, name)] = original = getattr(owner, name)
                setattr(owner, name, compat.run_as_plain_python(replace(original)))
        _guarded.add(ident)
    try:
        yield
    finally:
        if not nested:
            with _lock:
                _guarded.discard(ident)
                if not _guarded:
                    for (owner, name), original in _originals.items():
                        setattr(owner, name, original)
                    _originals.clear()
