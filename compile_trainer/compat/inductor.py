"""Inductor's per-process state: its compile workers, the installation's hashes that key its caches, its caches."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List

import torch

from .entry import Entry, Obsolete

__all__ = [
    "ENTRIES",
    "cache_counters",
    "fork_compile_workers",
    "fresh_inductor_cache",
    "inductor_cache_dir",
    "prefetch_compiler_keys",
    "warm_compile_workers",
]


def warm_compile_workers() -> None:
    """Start Inductor's compile-worker pool now. Inductor starts it at its first compile, and until the pool is
    ready Triton kernels compile in the compiling thread, holding the GIL. A no-op where the pool is not used (no
    Triton, one compile thread)."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def fork_compile_workers() -> bool:
    """Have Inductor fork its compile workers from this process (``worker_start_method = "fork"``) rather than from
    a sidecar process that imports torch first: on an H100 machine (torch 2.11, 16 workers) the pool was ready
    0.6 s after it was started instead of 10 s idle, 20-23 s beside a compile, and a cold regional compile of
    ConvNeXt-T, whose kernels compile one by one in the compiling thread until the pool is ready, reached its first
    step in 16.1 s instead of 20.5 s. False, changing nothing, where the user chose a start method
    (``TORCHINDUCTOR_WORKER_START``) or the pool exists already."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    if "TORCHINDUCTOR_WORKER_START" in os.environ or AsyncCompile.process_pool.cache_info().currsize:
        return False
    config.worker_start_method = "fork"
    return True


def _compiler_key_functions() -> List[Callable[[], Any]]:
    """The hashes of the installation that key Inductor's caches, each computed once per process by its first
    compile or cache load: torch's sources (``codecache.torch_key``) and Triton's sources and library
    (``codecache.triton_key`` from 2.12; before, ``runtime.triton_compat.triton_key``): 0.17 s and 0.41 s of a
    new machine's first step on an H100 (2.11)."""
    from torch._inductor import codecache

    functions: List[Callable[[], Any]] = [codecache.torch_key]
    if hasattr(codecache, "triton_key"):
        return [*functions, codecache.triton_key]
    try:
        from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key
    except ImportError:
        return functions
    return [*functions, triton_key] if HAS_TRITON else functions


_compiler_keys_prefetched = False


def prefetch_compiler_keys() -> None:
    """Start computing ``_compiler_key_functions`` in the background. From 2.12 through torch's own
    ``prefetchable_cache.prefetch`` (a caller that needs a key waits for the computation under way); before, on
    a daemon thread filling their ``functools`` caches (a caller that comes first computes it too)."""
    global _compiler_keys_prefetched
    if _compiler_keys_prefetched:
        return
    _compiler_keys_prefetched = True
    functions = _compiler_key_functions()
    if all(hasattr(function, "prefetch") for function in functions):
        for function in functions:
            function.prefetch()
        return

    def compute() -> None:
        for function in functions:
            try:
                function()
            except Exception as error:  # Inductor computes it again when it needs it, and reports then
                name = getattr(function, "__name__", function)
                logging.getLogger(__name__).debug("compiler key %s not prefetched: %r", name, error)

    threading.Thread(target=compute, name="compile_trainer-compiler-keys", daemon=True).start()


def fresh_inductor_cache() -> Any:
    """Empty Inductor and Triton caches for the duration (``fresh_cache``; ``fresh_inductor_cache`` before 2.10)."""
    from torch._inductor import utils

    return utils.fresh_cache() if hasattr(utils, "fresh_cache") else utils.fresh_inductor_cache()


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_<user>``); its
    ``triton/`` holds the compiled kernels unless ``TRITON_CACHE_DIR`` is set."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# Cache layer -> (counter group, hit counter, miss counter) in torch._dynamo.utils.counters (its probe finds the
# names in torch's sources, so a rename fails there).
_CACHE_COUNTERS = {
    "fx_graph": ("inductor", "fxgraph_cache_hit", "fxgraph_cache_miss"),
    "aot_autograd": ("aot_autograd", "autograd_cache_hit", "autograd_cache_miss"),
}


def cache_counters() -> Dict[str, tuple]:
    """Process-wide (hits, misses) per cache layer of Inductor and AOTAutograd so far."""
    counters = torch._dynamo.utils.counters
    return {
        layer: (counters[group][hit], counters[group][miss]) for layer, (group, hit, miss) in _CACHE_COUNTERS.items()
    }


# -- The probes --------------------------------------------------------------------------------------------


def _probe_warm_compile_workers() -> None:
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch.utils._triton import has_triton_package

    warm_compile_workers()
    if get_compile_threads() > 1 and has_triton_package() and os.environ.get("TORCH_WARM_POOL", "1") == "1":
        assert AsyncCompile.process_pool.cache_info().currsize == 1, "the worker pool exists once warmed"


def _probe_fork_compile_workers() -> None:
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    assert config.worker_start_method in ("subprocess", "fork", "spawn")
    assert callable(getattr(AsyncCompile.process_pool, "cache_info", None)), "the pool is created once, lru_cache'd"
    with config.patch(worker_start_method=config.worker_start_method):  # this process's own choice, restored
        assert config.worker_start_method == "fork" if fork_compile_workers() else True


def _probe_prefetch_compiler_keys() -> None:
    functions = _compiler_key_functions()
    assert functions and all(callable(function) for function in functions)
    prefetch_compiler_keys()
    keys = [function() for function in functions]  # waits for (or repeats) the prefetch: the same values
    assert isinstance(keys[0], bytes) and keys == [function() for function in functions]


def _probe_inductor_cache_dir() -> None:
    """Inductor's cache directory follows ``TORCHINDUCTOR_CACHE_DIR``, and ``fresh_cache`` moves it for a while."""
    before = inductor_cache_dir()
    assert os.path.isdir(before) and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    with fresh_inductor_cache():
        inside = inductor_cache_dir()
        assert inside != before and os.path.isdir(inside)
    assert inductor_cache_dir() == before


def _probe_cache_counters() -> None:
    """The counters are a defaultdict (a renamed one reads 0 forever): the names must be in torch's sources."""
    import inspect

    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import codecache

    sources = inspect.getsource(codecache) + inspect.getsource(autograd_cache)
    for group, hit, miss in _CACHE_COUNTERS.values():
        assert f'counters["{group}"]["{hit}"]' in sources and f'counters["{group}"]["{miss}"]' in sources, (hit, miss)
    counts = cache_counters()
    assert set(counts) == set(_CACHE_COUNTERS) and all(isinstance(n, int) for pair in counts.values() for n in pair)


ENTRIES = [
    Entry(
        "warm_compile_workers",
        _probe_warm_compile_workers,
        reaches=("torch._inductor.async_compile.maybe_warm_pool", "torch._inductor.async_compile.AsyncCompile"),
        checked=("2.9.1", "2.14.1"),
    ),
    Entry(
        "fork_compile_workers",
        _probe_fork_compile_workers,
        reaches=(
            "torch._inductor.config.worker_start_method",
            "torch._inductor.async_compile.AsyncCompile.process_pool",
        ),
        checked=("2.9.1", "2.11 H100", "2.14.1"),
        upstream=("https://github.com/pytorch/pytorch/pull/184130",),
    ),
    Entry(
        "prefetch_compiler_keys",
        _probe_prefetch_compiler_keys,
        reaches=(
            "torch._inductor.codecache.torch_key",
            "torch._inductor.codecache.triton_key",
            "torch._inductor.runtime.triton_compat.triton_key",
        ),
        checked=("2.9.1", "2.11 H100", "2.13", "2.14.1"),
        upstream=(
            "https://github.com/pytorch/pytorch/pull/182187",
            "https://github.com/pytorch/pytorch/pull/182188",
            "https://github.com/pytorch/pytorch/pull/182294",
        ),
        obsolete=(
            Obsolete(
                (2, 12),
                "_compiler_key_functions' fallback to runtime.triton_compat.triton_key and prefetch_compiler_keys' "
                "daemon thread (codecache.triton_key and the keys' .prefetch() from 2.12)",
            ),
        ),
    ),
    Entry(
        "inductor_cache_dir",
        _probe_inductor_cache_dir,
        reaches=("torch._inductor.runtime.cache_dir_utils.cache_dir", "torch._inductor.utils.fresh_cache"),
        checked=("2.13",),
        obsolete=(Obsolete((2, 10), "fresh_inductor_cache's fallback to torch._inductor.utils.fresh_inductor_cache"),),
    ),
    Entry(
        "cache_counters",
        _probe_cache_counters,
        reaches=(
            "torch._dynamo.utils.counters",
            "torch._inductor.codecache",
            "torch._functorch._aot_autograd.autograd_cache",
        ),
        checked=("2.13",),
    ),
]
