"""Where and when graphs are lowered, for compiling on a thread: Inductor's lowering routed per thread to its
compile subprocess, and AOTAutograd's backward lowered with the forward."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from .entry import Entry, Obsolete

__all__ = [
    "ENTRIES",
    "SubprocessLowerings",
    "eager_backward_lowering",
    "eager_backward_lowering_problem",
    "lowering_in_subprocess",
    "subprocess_lowering_problem",
    "warm_subprocess_lowering",
]

# AOTAutograd compiles the backward with the forward under this flag (2.11+; absent in 2.9.1 and 2.10).
_EAGER_BACKWARD_FLAG = "force_non_lazy_backward_lowering"


def eager_backward_lowering_problem() -> Optional[str]:
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, _EAGER_BACKWARD_FLAG):
        return (
            f"needs AOTAutograd to compile backward graphs with the forward (torch._functorch.config."
            f"{_EAGER_BACKWARD_FLAG}, present from torch 2.11), which torch {torch.__version__} lacks"
        )
    return None


def eager_backward_lowering() -> Any:
    import torch._functorch.config as functorch_config

    return functorch_config.patch({_EAGER_BACKWARD_FLAG: True})


@dataclass
class SubprocessLowerings:
    """What ``lowering_in_subprocess`` did with the graphs Inductor lowered: in its subprocess, or here (with why)."""

    in_subprocess: int = 0
    here: Dict[str, int] = field(default_factory=dict)  # reason -> graphs

    def lowered_here(self, reason: str) -> None:
        self.here[reason] = self.here.get(reason, 0) + 1


_lowering = threading.local()
_lowering_log = logging.getLogger("compile_trainer.compat.lowering")
# Op namespaces that torch itself registers at import, so the spawned subprocess has them too. Inductor's own
# pickler allows aten and fbgemm only; prims (an ``arange``'s iota) and Inductor's ops are in most training graphs.
_TORCH_OP_NAMESPACES = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.inductor.", "torch.ops.fbgemm.")


def _ops_filter(name: str) -> bool:
    if getattr(_lowering, "stats", None) is not None:
        return name.startswith(_TORCH_OP_NAMESPACES)
    from torch.fx._graph_pickler import _ops_filter_safe

    return _ops_filter_safe(name)


def _lower_in_subprocess(gm: Any, example_inputs: Any, inputs_to_check: Any, graph_kwargs: Dict[str, Any]) -> Any:
    """Inductor's ``_SerializedFxCompile.codegen_and_compile`` on its subprocess scheme, lowering here where the
    graph does not pickle or the subprocess fails (Inductor would raise)."""
    from torch._inductor.compile_fx import _InProcessFxCompile
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
    from torch._inductor.output_code import CompiledFxGraph

    stats: SubprocessLowerings = _lowering.stats
    region = graph_kwargs.pop("compile_region_name", None)
    scheme = _SubprocessFxCompile()
    serialized = scheme.serialize_compile(gm, example_inputs, inputs_to_check, graph_kwargs)
    if serialized is not None:
        pickled, constants = serialized
        try:
            output = scheme._send_to_child(pickled).deserialize(constants)
        except Exception as error:  # noqa: BLE001 - the graph is lowered here instead, and the reason kept
            details = str(getattr(error, "details", error)).strip()  # a SubprocException carries the child's traceback
            _lowering_log.info("Inductor's subprocess failed to lower a graph; lowering it here:\n%s", details)
            last = details.splitlines()[-1] if details else type(error).__name__
            stats.lowered_here(f"the subprocess failed: {last}")
        else:
            if isinstance(output.graph, CompiledFxGraph):
                output.graph.compile_region_name = region
            scheme._postprocess(output)
            stats.in_subprocess += 1
            return output.graph
    else:
        error = getattr(_lowering, "pickle_error", None)
        _lowering.pickle_error = None
        stats.lowered_here(f"the graph does not pickle ({error})" if error else "the graph does not pickle")
    here = _InProcessFxCompile()
    here.compile_region_name = region
    return here.codegen_and_compile(gm, example_inputs, inputs_to_check, graph_kwargs)


def _install_subprocess_lowering() -> None:
    """Route ``fx_codegen_and_compile`` (Inductor's lowering of one AOT graph) through ``_lower_in_subprocess`` on
    threads inside ``lowering_in_subprocess``; other threads call it as before."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.compile_fx_ext as compile_fx_ext
    import torch.fx._graph_pickler as graph_pickler
    from torch._inductor.virtualized import NullHandler, V

    if getattr(compile_fx.fx_codegen_and_compile, "_compile_trainer_lowering", False):
        return
    original = compile_fx.fx_codegen_and_compile

    def fx_codegen_and_compile(gm: Any, example_inputs: Any, inputs_to_check: Any, **graph_kwargs: Any) -> Any:
        if getattr(_lowering, "stats", None) is None:
            return original(gm, example_inputs, inputs_to_check, **graph_kwargs)
        return _lower_in_subprocess(gm, example_inputs, inputs_to_check, graph_kwargs)

    fx_codegen_and_compile._compile_trainer_lowering = True
    compile_fx.fx_codegen_and_compile = fx_codegen_and_compile
    serializer = compile_fx_ext._VirtualizedSerializer
    serialize = serializer.serialize

    def serialize_unset_as_unset() -> Any:
        # The child poisons every virtualized value the serializer lacks, and Inductor's codegen reads some of them
        # unset (2.11: the mix-order reduction of an RMSNorm's backward reads V.interpreter, "Attempt to use
        # poisoned virtualized value"): values unset here are sent as unset.
        state = serialize()
        if getattr(_lowering, "stats", None) is not None:
            for name in _virtualized_names():
                value = getattr(V, name)
                if not hasattr(state, name) and isinstance(value, NullHandler):
                    setattr(state, name, value)
        return state

    serializer.serialize = staticmethod(serialize_unset_as_unset)
    # GraphPickler's Options() defaults to the aten-only filter (the default is bound at class creation)
    defaults = list(graph_pickler.Options.__init__.__defaults__)
    defaults[0] = _ops_filter
    graph_pickler.Options.__init__.__defaults__ = tuple(defaults)


def _virtualized_names() -> List[str]:
    """The names of Inductor's virtualized values, as the child's patch finds them (``set_<name>[_handler]``)."""
    from torch._inductor.virtualized import V

    return [name[4:].removesuffix("_handler") for name in dir(V) if name.startswith("set_")]


def subprocess_lowering_problem() -> Optional[str]:
    try:
        import torch._inductor.compile_fx as compile_fx
        import torch.fx._graph_pickler as graph_pickler
        from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
    except ImportError as error:
        return f"needs Inductor's subprocess compile (torch._inductor.compile_fx_subproc), missing: {error}"
    fields = [f.name for f in dataclasses.fields(graph_pickler.Options)]
    if not hasattr(compile_fx, "fx_codegen_and_compile") or fields[:1] != ["ops_filter"]:
        return f"needs Inductor's fx_codegen_and_compile and GraphPickler's ops_filter (torch {torch.__version__})"
    if not all(hasattr(_SubprocessFxCompile, name) for name in ("serialize_compile", "_send_to_child")):
        return f"needs _SubprocessFxCompile.serialize_compile and _send_to_child (torch {torch.__version__})"
    return None


@contextlib.contextmanager
def lowering_in_subprocess(stats: SubprocessLowerings) -> Iterator[None]:
    """On this thread, Inductor lowers each graph (the Python-heavy half of a compile, after Dynamo and AOTAutograd)
    in a subprocess, Inductor's own: its one worker is spawned once per process and kept; the thread waits for it
    without holding the GIL. Graphs that do not pickle (higher-order ops, user-registered ops) are lowered here."""
    _install_subprocess_lowering()
    previous = getattr(_lowering, "stats", None)
    _lowering.stats = stats
    logger = logging.getLogger("torch._inductor.compile_fx")  # compile_fx_ext logs through it
    quiet = _PickleWarningToReason(threading.get_ident())
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        _lowering.stats = previous


class _PickleWarningToReason(logging.Filter):
    """Inductor warns with a traceback for each graph it cannot pickle and lowers it in process; on the lowering
    thread the warning becomes the reason ``SubprocessLowerings`` keeps."""

    def __init__(self, thread: int):
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread or not str(record.msg).startswith("Unable to pickle"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        _lowering.pickle_error = str(error).strip().splitlines()[0] if error is not None and str(error) else None
        return False


def warm_subprocess_lowering() -> None:
    """Spawn the lowering subprocess now (it imports torch: seconds), before a compile needs it."""
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    _SubprocessFxCompile.process_pool()


# -- The probes --------------------------------------------------------------------------------------------


def _probe_eager_backward_lowering() -> None:
    import torch._functorch.config as functorch_config

    assert eager_backward_lowering_problem() is None
    before = getattr(functorch_config, _EAGER_BACKWARD_FLAG)
    with eager_backward_lowering():
        assert getattr(functorch_config, _EAGER_BACKWARD_FLAG) is True
    assert getattr(functorch_config, _EAGER_BACKWARD_FLAG) == before


def _probe_lowering_in_subprocess() -> None:
    """The routing, the op filter and the virtualized values as ``_lower_in_subprocess`` relies on them (a real
    lowering in the subprocess: tests/test_background.py)."""
    import inspect

    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.compile_fx_ext as compile_fx_ext
    import torch._inductor.compile_fx_subproc as compile_fx_subproc
    from torch._inductor.compile_worker.subproc_pool import SubprocException
    from torch._inductor.virtualized import NullHandler, V
    from torch.fx._graph_pickler import Options

    assert subprocess_lowering_problem() is None, subprocess_lowering_problem()
    warm_subprocess_lowering()
    assert compile_fx_subproc._SubprocessFxCompile.process_pool.cache_info().currsize == 1, "spawned once, kept"
    _install_subprocess_lowering()
    assert "fx_codegen_and_compile(" in inspect.getsource(compile_fx._compile_fx_inner), "looked up as a global"
    assert "Unable to pickle" in inspect.getsource(compile_fx_ext._SerializedFxCompile.serialize_compile)
    assert SubprocException("trace").details == "trace"
    prims, foreign = "torch.ops.prims.iota.default", "torch.ops.somelib.op.default"
    assert not Options().ops_filter(prims) and Options().ops_filter("torch.ops.aten.mm.default")
    with lowering_in_subprocess(SubprocessLowerings()):
        assert Options().ops_filter(prims) and not Options().ops_filter(foreign)
        state = compile_fx_ext._VirtualizedSerializer.serialize()
        with state.patch():
            assert isinstance(V.interpreter, NullHandler), "an unset value arrives unset, not poisoned"
    assert isinstance(V.interpreter, NullHandler)


ENTRIES = [
    Entry(
        "lowering_in_subprocess",
        _probe_lowering_in_subprocess,
        reaches=(
            "torch._inductor.compile_fx.fx_codegen_and_compile",
            "torch._inductor.compile_fx_subproc._SubprocessFxCompile",
            "torch._inductor.compile_fx_ext._VirtualizedSerializer",
            "torch.fx._graph_pickler.Options",
            "torch._inductor.virtualized.V",
        ),
        checked=("2.9.1", "2.11 H100", "2.14.1"),
        upstream=("https://github.com/pytorch/pytorch/pull/146134",),
    ),
    Entry(
        "eager_backward_lowering",
        _probe_eager_backward_lowering,
        reaches=("torch._functorch.config.force_non_lazy_backward_lowering",),
        checked=("2.11 H100", "2.13"),
        present_from=(2, 11),
        obsolete=(
            Obsolete(
                (2, 11),
                "eager_backward_lowering_problem, its callers' checks (compiling/runtime_checks.py, "
                "shapes/bucket_warmup.py) and this entry's present_from",
            ),
        ),
    ),
]
