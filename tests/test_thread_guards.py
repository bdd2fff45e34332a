"""A guarded thread's process-wide side effects stay on it: FX's method patches (and, in test_backends, the
random-number restores)."""

import contextlib
import threading

import pytest
import torch
from torch import nn

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
