import threading

import pytest
import torch
from torch._dynamo.utils import counters

from compile_trainer.backends import CompiledNotRun, CompileOnlyBackend, compile_only


def scale(x):
    return torch.sin(x) * 2


def test_compile_only_compiles_a_graph_that_other_threads_then_run_without_compiling():
    torch._dynamo.reset()
    on_thread = torch.compile(scale, backend=CompileOnlyBackend("aot_eager", None, None, None))
    outcome = []

    def compile_in_background():
        with compile_only():
            try:
                on_thread(torch.ones(3))
                outcome.append("ran")
            except CompiledNotRun:
                outcome.append("compiled, not run")

    graphs = counters["stats"]["unique_graphs"]
    thread = threading.Thread(target=compile_in_background)
    thread.start()
    thread.join()
    assert outcome == ["compiled, not run"] and counters["stats"]["unique_graphs"] == graphs + 1
    # Another torch.compile with equal settings (as each region of a shared entry has) hits the same entry.
    here = torch.compile(scale, backend=CompileOnlyBackend("aot_eager", None, None, None))
    assert torch.equal(here(torch.ones(3)), scale(torch.ones(3)))
    assert counters["stats"]["unique_graphs"] == graphs + 1, "the thread's compile was reused"
    with pytest.raises(CompiledNotRun), compile_only():
        here(torch.ones(3))


def test_backends_with_different_settings_are_not_equal():
    inductor = CompileOnlyBackend("inductor", "reduce-overhead", None, None)
    assert inductor == CompileOnlyBackend("inductor", "reduce-overhead", None, None)
    assert inductor != CompileOnlyBackend("inductor", None, None, None)
    assert inductor != CompileOnlyBackend("inductor", "reduce-overhead", {"triton.cudagraphs": False}, None)
