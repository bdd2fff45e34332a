"""A guarded thread's process-wide side effects stay on it: FX's method patches, the compiling flag, subprocess
starts beside forks (and, in test_backends, the random-number restores)."""

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn
from torch._dynamo.callback import callback_handler

from compile_trainer import compat
from compile_trainer.compiling.thread_guards import REPLACEMENTS, blind_to_guarded_tracing, forks_wait, guarded_thread


class PausesWhileTraced(nn.Module):
    """Its forward, run by FX's tracer, stops until released: the test calls modules meanwhile."""

    def __init__(self):
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        self.inside.set()
        self.release.wait(timeout=60)
        return self.linear(x)


def call_a_module_while_another_thread_traces(guarded: bool, call=None):
    """``call()`` (by default an eager module's) on this thread while another thread's FX trace has patched
    ``nn.Module.__call__``; returns its result."""
    traced = PausesWhileTraced()
    errors = []

    def trace():
        with guarded_thread() if guarded else contextlib.nullcontext():
            try:
                torch.fx.symbolic_trace(traced)
            except Exception as error:  # the release below always comes; a failure here is reported
                errors.append(error)

    thread = threading.Thread(target=trace)
    thread.start()
    traced.inside.wait(timeout=60)
    try:
        if call is not None:
            return call()
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        return model(torch.ones(1, 2))  # the training thread's eager step
    finally:
        traced.release.set()
        thread.join()
        assert not errors, errors


def test_fx_tracing_on_another_thread_breaks_module_calls_unless_that_thread_is_guarded():
    originals = {key: getattr(*key) for key in REPLACEMENTS}
    with pytest.raises(NameError, match="not installed as a submodule"):
        call_a_module_while_another_thread_traces(guarded=False)
    assert call_a_module_while_another_thread_traces(guarded=True).shape == (1, 3)
    assert {key: getattr(*key) for key in REPLACEMENTS} == originals, "the originals are back"
    assert nn.Module.__call__ is nn.Module._wrapped_call_impl, "FX's patch was reverted"


class AroundAnEagerPart(nn.Module):
    """Compiled whole around a part whose forward runs eagerly, as regional's outer road around a stack."""

    def __init__(self):
        super().__init__()
        self.before, self.eager_part = nn.Linear(2, 2), nn.Linear(2, 3)
        self.eager_part.forward = torch.compiler.disable(self.eager_part.forward)

    def forward(self, x):
        return self.eager_part(self.before(x))


def test_compiled_code_calling_a_module_while_a_guarded_thread_traces_compiles_no_frame_of_the_guards():
    """Compiled code calls the eager part after its break through ``nn.Module.__call__``, which a guarded thread's FX
    trace has replaced with a thread-aware function meanwhile: Dynamo, which intercepts every new frame under compiled
    code, runs that function as plain Python. Compiling it broke a graph at FX's skipped wrapper: one graph break
    counted in T5-base's outer region beside a background compile (H100, torch 2.11)."""
    model = AroundAnEagerPart()
    with blind_to_guarded_tracing():  # as the regions are compiled
        compiled = torch.compile(model, backend="eager")
    compiled(torch.ones(1, 2))  # every frame compiled before the other thread traces
    compiles = []
    callback_handler.register_start_callback(compiles.append)
    try:
        result = call_a_module_while_another_thread_traces(True, lambda: compiled(torch.ones(1, 2)))
    finally:
        callback_handler.remove_start_callback(compiles.append)
    torch.testing.assert_close(result, model(torch.ones(1, 2)))
    assert compiles == [], "no frame compiled beside the trace"


def is_compiling_seen_on_this_thread_while_another_compiles(guarded: bool) -> bool:
    """``torch.compiler.is_compiling()`` read here while another thread is inside a Dynamo compile (held there by
    a compile-start callback until the read is done)."""
    inside, release = threading.Event(), threading.Event()
    compiling_thread = []

    def hold(*args):
        if threading.current_thread() in compiling_thread:
            inside.set()
            release.wait(timeout=60)

    def compile_a_function():
        with guarded_thread() if guarded else contextlib.nullcontext():
            torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))

    thread = threading.Thread(target=compile_a_function)
    compiling_thread.append(thread)
    callback_handler.register_start_callback(hold)
    try:
        thread.start()
        assert inside.wait(timeout=60), "the other thread never started compiling"
        return torch.compiler.is_compiling()
    finally:
        release.set()
        thread.join()
        callback_handler.remove_start_callback(hold)


@pytest.mark.skipif(compat.compile_session_owner() is None, reason="this torch has no process-wide compiling flag")
def test_a_compile_on_another_thread_makes_this_thread_compiling_unless_that_thread_is_guarded():
    """What made collectives in the training step refuse to run beside a background compile (torch 2.13)."""
    torch._dynamo.reset()
    originals = {key: getattr(*key) for key in REPLACEMENTS}
    assert is_compiling_seen_on_this_thread_while_another_compiles(guarded=False)
    torch._dynamo.reset()
    assert not is_compiling_seen_on_this_thread_while_another_compiles(guarded=True)
    assert {key: getattr(*key) for key in REPLACEMENTS} == originals, "the originals are back"
    assert not torch.compiler.is_compiling()


def seconds_to_fork(started: threading.Event) -> float:
    """How long ``os.fork()`` on this thread takes 0.3 s after ``started`` is set."""
    assert started.wait(timeout=30)
    time.sleep(0.3)
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    seconds = time.perf_counter() - began
    os.waitpid(pid, 0)
    return seconds


def fork_while_another_thread_starts_a_subprocess(guarded: bool) -> float:
    """The subprocess's child sleeps 1 s before its exec: the time in which ``Popen`` waits on a pipe that a fork
    would copy into the forked process (and then wait for that process's exit)."""
    started = threading.Event()

    def start_subprocess():
        with guarded_thread() if guarded else contextlib.nullcontext():
            started.set()
            subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: time.sleep(1.0), check=True)

    thread = threading.Thread(target=start_subprocess)
    thread.start()
    try:
        return seconds_to_fork(started)
    finally:
        thread.join()


def test_a_fork_waits_while_a_guarded_threads_subprocess_starts():
    """A fork (a DataLoader's workers) while a compile thread's ``Popen`` (Inductor's workers, gcc) starts its child
    copied the pipe ``Popen`` waits on: the thread then waited for the forked process to exit (CPU: 5 of 150
    subprocess starts beside forks of 2 s processes waited 2 s)."""
    original = subprocess.Popen._execute_child
    assert fork_while_another_thread_starts_a_subprocess(guarded=False) < 0.3, "a fork waits for nothing by itself"
    waited = fork_while_another_thread_starts_a_subprocess(guarded=True)
    assert waited > 0.4, f"the fork went ahead after {waited:.2f} s while the subprocess was starting"
    assert subprocess.Popen._execute_child is original, "the original is back"


def test_a_fork_waits_for_a_forks_wait_block():
    """What the compile cache's loading thread holds around each artifact (it starts subprocesses)."""
    holding, release, forked = threading.Event(), threading.Event(), threading.Event()

    def load():
        with forks_wait():
            holding.set()
            release.wait(timeout=30)

    def fork():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        forked.set()

    loader = threading.Thread(target=load)
    loader.start()
    assert holding.wait(timeout=30)
    forker = threading.Thread(target=fork)
    forker.start()
    assert not forked.wait(timeout=0.5), "the fork went ahead inside the block"
    release.set()
    assert forked.wait(timeout=30), "the fork waited past the block"
    loader.join(), forker.join()
