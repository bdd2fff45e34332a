"""A guarded thread's process-wide side effects stay on it: FX's method patches, the compiling flag (and, in
test_backends, the random-number restores)."""

import contextlib
import threading

import pytest
import torch
from torch import nn
from torch._dynamo.callback import callback_handler

from compile_trainer import compat
from compile_trainer.compiling.thread_guards import REPLACEMENTS, guarded_thread


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


def call_a_module_while_another_thread_traces(guarded: bool):
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
