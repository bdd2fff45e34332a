import contextlib
import itertools
import threading

import pytest
import torch
from torch._dynamo.utils import counters

from compile_trainer.compiling.backends import CompiledNotRun, RegionBackend, compile_only


def scale(x):
    return torch.sin(x) * 2


def test_compile_only_compiles_a_graph_that_other_threads_then_run_without_compiling():
    torch._dynamo.reset()
    on_thread = torch.compile(scale, backend=RegionBackend("aot_eager", None, None, None))
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
    here = torch.compile(scale, backend=RegionBackend("aot_eager", None, None, None))
    assert torch.equal(here(torch.ones(3)), scale(torch.ones(3)))
    assert counters["stats"]["unique_graphs"] == graphs + 1, "the thread's compile was reused"
    with pytest.raises(CompiledNotRun), compile_only():
        here(torch.ones(3))


def test_backends_with_different_settings_are_not_equal():
    inductor = RegionBackend("inductor", "reduce-overhead", None, None)
    assert inductor == RegionBackend("inductor", "reduce-overhead", None, None)
    assert inductor != RegionBackend("inductor", None, None, None)
    assert inductor != RegionBackend("inductor", "reduce-overhead", {"triton.cudagraphs": False}, None)


PAUSED_NAMES = itertools.count()


class PausedCompile:
    """A backend that stops inside the compile until released, so the test decides what happens meanwhile."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, graph, example_inputs):
        self.inside.set()
        self.release.wait(timeout=60)
        return graph.forward


def draws_around_a_compile_on_another_thread(compile_only_thread: bool):
    """Random draws made while another thread compiles, and the draws right after it has finished."""
    import random

    paused = PausedCompile()
    name = f"paused_for_test_{next(PAUSED_NAMES)}"  # Dynamo's registry refuses a name twice
    torch._dynamo.register_backend(paused, name=name)
    compiled = torch.compile(scale, backend=RegionBackend(name, None, None, None))

    def compile_in_background():
        with compile_only() if compile_only_thread else contextlib.nullcontext():
            with contextlib.suppress(CompiledNotRun):
                compiled(torch.ones(3))

    torch.manual_seed(0)
    random.seed(0)
    thread = threading.Thread(target=compile_in_background)
    thread.start()
    paused.inside.wait(timeout=60)
    during = (torch.rand(4), random.random())  # the training thread draws while the thread compiles
    paused.release.set()
    thread.join()
    return during, (torch.rand(4), random.random())


def test_a_compile_only_thread_does_not_rewind_the_training_threads_random_numbers():
    import random

    originals = (torch.random.set_rng_state, torch.cuda.set_rng_state, random.setstate)
    torch._dynamo.reset()
    during, after = draws_around_a_compile_on_another_thread(compile_only_thread=False)
    assert torch.equal(during[0], after[0]) and during[1] == after[1], "a plain compile restores the old state"
    torch._dynamo.reset()
    during, after = draws_around_a_compile_on_another_thread(compile_only_thread=True)
    assert not torch.equal(during[0], after[0]) and during[1] != after[1], "no draw comes twice"
    assert (torch.random.set_rng_state, torch.cuda.set_rng_state, random.setstate) == originals, "unpatched after"
