"""Inductor's CUDA graphs: the trees' per-thread state, the functions they warmed up, the graphs run without them."""

from __future__ import annotations

import sys

import torch

from .entry import Entry

__all__ = ["ENTRIES", "TREE_CONTAINERS", "cudagraph_skips", "cudagraph_warmed_up_functions", "import_cudagraph_trees"]


def cudagraph_skips() -> int:
    """Graphs Inductor compiled for CUDA graphs and then ran without them (``counters["inductor"]``)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


TREE_CONTAINERS = "tree_manager_containers"  # CUDA-graph trees' per-thread state: device index -> container


def cudagraph_warmed_up_functions() -> int:
    """Functions CUDA-graph trees have warmed up on this thread's devices (``CUDAGraphTreeManager.
    warmed_up_functions``). A compiled function runs once without a graph before it is recorded, and every function
    after it in that step runs so too; a step during which this count changes ran its graphs unrecorded (a new
    region installed by a background compile warms the whole step up): no steady step."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not (hasattr(trees.local, TREE_CONTAINERS) or torch._C._is_key_in_tls(TREE_CONTAINERS)):
        return 0  # no CUDA graph run on this thread yet (reading would create its state)
    containers = trees.get_obj(trees.local, TREE_CONTAINERS).values()
    return sum(len(c.tree_manager.warmed_up_functions) for c in containers if c.tree_manager is not None)


def import_cudagraph_trees() -> None:
    """CUDA graph trees create per-thread state on import; the thread that runs the graphs needs it (2.11)."""
    import torch._inductor.cudagraph_trees  # noqa: F401


# -- The probes --------------------------------------------------------------------------------------------


def _probe_cudagraph_skips() -> None:
    """A counter that never moves on the CPU: its name must be the one Inductor increments."""
    import inspect

    from torch._inductor import cudagraph_utils

    assert isinstance(cudagraph_skips(), int)
    assert 'counters["inductor"]["cudagraph_skips"]' in inspect.getsource(cudagraph_utils)


def _probe_cudagraph_trees() -> None:
    import_cudagraph_trees()
    assert "torch._inductor.cudagraph_trees" in sys.modules


def _probe_cudagraph_warmups() -> None:
    import inspect

    from torch._inductor import cudagraph_trees

    assert cudagraph_warmed_up_functions() == 0, "no CUDA graph has run in the probe's process"
    assert TREE_CONTAINERS in inspect.getsource(cudagraph_trees.get_container)
    assert "self.warmed_up_functions.add(function_id)" in inspect.getsource(cudagraph_trees.CUDAGraphTreeManager)
    assert callable(cudagraph_trees.get_obj) and hasattr(cudagraph_trees, "local")


ENTRIES = [
    Entry(
        "cudagraph_skips",
        _probe_cudagraph_skips,
        reaches=("torch._dynamo.utils.counters", "torch._inductor.cudagraph_utils"),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "import_cudagraph_trees",
        _probe_cudagraph_trees,
        reaches=("torch._inductor.cudagraph_trees",),
        checked=("2.9.1", "2.11 H100", "2.13"),
    ),
    Entry(
        "cudagraph_warmed_up_functions",
        _probe_cudagraph_warmups,
        reaches=(
            "torch._inductor.cudagraph_trees.get_container",
            "torch._inductor.cudagraph_trees.CUDAGraphTreeManager",
            "torch._inductor.cudagraph_trees.get_obj",
            "torch._C._is_key_in_tls",
        ),
        checked=("2.9.1", "2.14.1"),
    ),
]
