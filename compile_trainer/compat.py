"""Every private torch API the library uses, in one place, with the torch versions it was checked on.

The rest of the package reaches torch's internals only through this module. Each entry says what it
reaches, the versions it was checked on ("checked": read in the sources and run; CPU unless said), and the
upstream issue or PR where one exists. ``ENTRIES`` lists a probe per entry, which uses it as the library does and
asserts what the library relies on (names, fields, texts, effects): ``tests/test_compat.py`` runs every probe on
the installed torch, so a torch upgrade that moves or changes one of them fails there first, by name.

Supported: torch >= 2.9 (checked on 2.9.1, 2.13.0 on the CPU; 2.11.0 on an H100).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

MIN_TORCH = (2, 9)


def torch_version() -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def needs_torch(feature: str, version: tuple) -> Optional[str]:
    """``None`` when the installed torch is at least ``version``; else a sentence saying what ``feature`` needs."""
    if torch_version() >= version:
        return None
    return f"{feature} needs torch >= {'.'.join(map(str, version))}; this is torch {torch.__version__}"


def renamed_function(function: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``function`` (defaults and closure kept) with a code object of its own named ``name``: Dynamo
    caches compiled code per code object, and its metrics report the code's name. Public Python, kept here, at
    the bottom of the package, so that every layer and the probes below share the one copy."""
    code = function.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


# -- Dynamo: compile events -------------------------------------------------------------------------------
# torch._dynamo.callback.callback_handler: compile start/end callbacks with a trigger and a compile id
# (2.8+; checked 2.9.1-2.13). torch._dynamo.reset() clears the handlers: register again after a reset.


def dynamo_callback_handler() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError as error:  # pragma: no cover - torch < 2.8
        raise RuntimeError(f"compile telemetry {needs_torch('torch._dynamo.callback', (2, 8))}") from error
    return callback_handler


def compilation_metrics() -> Any:
    """Dynamo's bounded deque of ``CompilationMetrics`` (fields vary by version: read with ``getattr``).

    ``recompile_reason`` from 2.7; checked 2.9.1-2.13.
    """
    return torch._dynamo.utils.get_compilation_metrics()


def functions_closed_over() -> Tuple[int, ...]:
    """From a Dynamo compile-start callback: the functions the frame being compiled closes over (the ``id`` of each
    closure cell holding one), read from the arguments of ``convert_frame._compile`` on the stack (checked 2.9.1,
    2.13, 2.14.1). A decorator's wrapper is one code object serving every function it wraps, told apart by its
    ``func`` cell: Dynamo caches its graphs per code object, so the second function's first compile reads as a
    recompile. () where the frame closes over no function (or ``_compile`` is not on the stack)."""
    from torch._dynamo import convert_frame

    target = inspect.unwrap(convert_frame._compile).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not target:
        frame = frame.f_back
    if frame is None:
        return ()
    contents = []
    for cell in frame.f_locals.get("closure") or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return tuple(id(value) for value in contents if isinstance(value, (types.FunctionType, types.MethodType)))


def graph_break_reasons() -> list:
    """One ``GraphCompileReason`` per graph break (the list ``torch._dynamo.explain`` reads; checked 2.9.1-2.13)."""
    reasons = getattr(torch._dynamo.utils, "graph_break_reasons", None)
    if reasons is None:  # pragma: no cover
        raise RuntimeError(f"torch {torch.__version__} has no torch._dynamo.utils.graph_break_reasons")
    return reasons


def unique_graphs() -> int:
    """Graphs Dynamo has compiled in this process (``counters["stats"]``; process-wide, never reset)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cudagraph_skips() -> int:
    """Graphs Inductor compiled for CUDA graphs and then ran without them (``counters["inductor"]``)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


# Dynamo's texts: matched where it gives no structured field (checked 2.9.1-2.13).
FAIL_ON_RECOMPILE = "fail_on_recompile"  # the RuntimeError under set_stance("fail_on_recompile")
GRAD_MODE_GUARD = "GLOBAL_STATE changed: grad_mode"  # recompile_reason when the graph checked was another grad mode's
# recompile_reason when an input tensor requires grad and the graph's did not, or the other way round:
# "tensor 'args[0]' requires_grad mismatch. expected requires_grad=0"
REQUIRES_GRAD_GUARD = re.compile(r"^tensor '[^']+' requires_grad mismatch")
# fail_reason at the limit: "recompile_limit reached" (2.9.1), "recompile limit" (2.10+), "cache_size_limit" before
RECOMPILE_LIMIT_TEXTS = ("recompile limit", "recompile_limit", "cache_size_limit")


def is_fail_on_recompile(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and FAIL_ON_RECOMPILE in str(error)


def is_recompile_limit(fail_reason: str) -> bool:
    return any(text in fail_reason.lower() for text in RECOMPILE_LIMIT_TEXTS)


def _loop_with_a_break(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = x + 1
        torch._dynamo.graph_break()
    return x


@functools.cache
def reports_frames_run_eagerly_at_a_loop_break() -> bool:
    """Whether a frame Dynamo runs eagerly because a graph break sits in a loop has a ``fail_type`` in its compile
    metrics (2.13, 2.14.1). torch 2.9.1 records it like a frame with no tensor code (no failure, no graph, no
    counter): such a fallback cannot be told apart there, and is not reported. Found by compiling one such loop."""
    torch.compile(_fresh(_loop_with_a_break), backend="eager")(torch.ones(1))
    return getattr(compilation_metrics()[-1], "fail_type", None) is not None


# Dynamo's errors end with the user frames it traced ('from user code:', each 'File "f", line n, in name' and the
# line's code); where the traced code raised, the debug context names the exception (2.13, 2.14.1)
TRACED_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+(?:\n[ \t]+(\S.*))?')
TRACED_EXCEPTION = re.compile(r"raised exception (.+)")


def traced_error_summary(error: BaseException) -> str:
    """A Dynamo error in one line: what failed (the exception the traced code raised, else the message's first line)
    and the last user line it traced (``file.py:line `code```). Another error: its type and first line. Checked
    2.9.1-2.14.1."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # "backend='inductor' raised:" and the backend's error below it
        first = f"{first} {lines[1]}"
    first = " ".join(first.split())[:200]  # Dynamo's can run on for a paragraph
    raised = TRACED_EXCEPTION.search(text)
    if raised:
        what = raised.group(1).strip()
    else:
        what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    frames = TRACED_USER_FRAME.findall(text)
    if not frames:
        return what
    file, line, code = frames[-1]
    return f"{what} at {os.path.basename(file)}:{line}" + (f" `{code.strip()}`" if code else "")


# -- Dynamo: settings --------------------------------------------------------------------------------------


def recompile_limit() -> int:
    return torch._dynamo.config.recompile_limit


def set_recompile_limit(limit: int) -> int:
    """Set Dynamo's process-wide recompile limit; returns the previous one (to restore it with)."""
    previous = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = limit
    return previous


# torch._dynamo.config.enable_compiler_collectives: ranks exchange Dynamo's size observations at each compile so
# that every rank makes the same dynamic/static decision (checked 2.13 on the CPU, 2 gloo processes).


def compiler_collectives() -> bool:
    return bool(torch._dynamo.config.enable_compiler_collectives)


def set_compiler_collectives(enabled: bool) -> bool:
    """Turn Dynamo's compiler collectives on or off; returns the previous value."""
    previous = compiler_collectives()
    torch._dynamo.config.enable_compiler_collectives = enabled
    return previous


# torch._dynamo.config.optimize_ddp: True or "ddp_optimizer" splits each graph compiled inside DDP's forward at
# the bucket boundaries (DDPOptimizer; convert_frame asks DistributedDataParallel._get_active_ddp_module()), False
# or "no_optimization" leaves graphs whole; other strings are compiled-autograd modes ("python_reducer"), left as set.


def ddp_optimizer_on() -> bool:
    return torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"


def turn_off_ddp_optimizer() -> Any:
    """Turn Dynamo's DDPOptimizer off where it is on; returns the previous ``optimize_ddp`` (to restore it with)."""
    previous = torch._dynamo.config.optimize_ddp
    if ddp_optimizer_on():
        torch._dynamo.config.optimize_ddp = False
    return previous


def set_optimize_ddp(value: Any) -> None:
    torch._dynamo.config.optimize_ddp = value


def ignored_logger_methods() -> set:
    return set(torch._dynamo.config.ignore_logger_methods)


def set_ignored_logger_methods(methods: set) -> set:
    """Logger methods Dynamo drops while tracing instead of breaking the graph (``ignore_logger_methods``, 2.6+;
    an alias of ``ignore_logging_functions`` from 2.12); returns the previous set, to restore it with.

    Torch up to 2.11 writes this set into every compile's metrics as JSON, and a function is not JSON: each compile
    then logs "Unexpected exception logging compilation metrics" and its metrics are lost (seen on 2.11: no
    recompile reasons, no compile times). There, each method goes in as a ``LoggerMethodName``, which Dynamo's
    membership test still matches and JSON writes as its name; ``dynamo_config_loggable`` checks the result.
    """
    previous = ignored_logger_methods()
    torch._dynamo.config.ignore_logger_methods = set(methods)
    if not dynamo_config_loggable():
        torch._dynamo.config.ignore_logger_methods = {LoggerMethodName.of(method) for method in methods}
    return previous


class LoggerMethodName(str):
    """A logger method in Dynamo's ignore set that equals (and hashes as) the method, and is JSON as its name."""

    method: Callable[..., Any]

    @classmethod
    def of(cls, method: Callable[..., Any]) -> Any:
        if isinstance(method, cls):
            return method
        name = cls(f"{getattr(method, '__module__', '')}.{getattr(method, '__qualname__', repr(method))}")
        name.method = method
        return name

    def __eq__(self, other: object) -> bool:
        return other is self.method or (isinstance(other, LoggerMethodName) and other.method is self.method)

    def __ne__(self, other: object) -> bool:  # str's own would compare the name
        return not self == other

    def __hash__(self) -> int:
        return hash(self.method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


def dynamo_config_loggable() -> bool:
    """Whether Dynamo can write its config into a compile's metrics (``_get_dynamo_config_for_logging``, checked
    2.9.1-2.13); True where torch has no such function."""
    config_for_logging = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    if config_for_logging is None:
        return True
    try:
        config_for_logging()
    except (TypeError, ValueError):
        return False
    return True


def list_backends() -> List[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def lookup_backend(name: str) -> Callable[..., Any]:
    return torch._dynamo.lookup_backend(name)


def inductor_backend(mode: Optional[str], options: Optional[Dict[str, Any]], dynamic: Optional[bool]) -> Any:
    """The backend object ``torch.compile(backend="inductor", mode=..., options=...)`` builds (checked 2.9.1-2.13)."""
    return torch._TorchCompileInductorWrapper(mode, options, dynamic)


def inductor_mode_options(mode: str) -> Dict[str, Any]:
    return torch._inductor.list_mode_options(mode)


def inductor_options_without_size_guards() -> Dict[str, Any]:
    """Inductor options under which Inductor guards on no dynamic size of its own.

    The mix-order reduction (torch >= 2.10; fuses a norm's backward reductions) decides with
    ``evaluate_expr(nrow * ncol >= 5 * 2**20)``, a guard on the symbolic length: a stream of lengths crossing that
    size compiled a second graph (``6144*idx.size()[1] >= 5242880``, H100, torch 2.11). Its non-strict mode
    skips the size checks and fuses whatever the size.
    """
    triton_config = torch._inductor.config.triton
    if hasattr(triton_config, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


# -- Shapes ------------------------------------------------------------------------------------------------
# mark_dynamic and friends live in torch._dynamo (documented, but under a private package; 2.0+).


def mark_dynamic(tensor: torch.Tensor, dim: Any, min: Optional[int] = None, max: Optional[int] = None) -> None:
    torch._dynamo.mark_dynamic(tensor, dim, min=min, max=max)


def maybe_mark_dynamic(tensor: torch.Tensor, dims: Any) -> None:
    torch._dynamo.maybe_mark_dynamic(tensor, dims)


def mark_static_address(tensor: torch.Tensor) -> None:
    """A tensor whose storage stays put: CUDA graphs need not copy it, and no guard is added on its address."""
    torch._dynamo.mark_static_address(tensor, guard=False)


# The marks are attributes of the tensor object, named ``_dynamo_*`` (``_dynamo_dynamic_indices``,
# ``_dynamo_static_input_type``...; checked 2.9.1-2.13): a copy of a tensor keeps them only if they are copied.
DYNAMO_MARK_PREFIX = "_dynamo"


def copy_dynamo_marks(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` with each of Dynamo's shape marks that ``source`` carries (a shallow copy of each)."""
    for name, mark in vars(source).items():
        if name.startswith(DYNAMO_MARK_PREFIX):
            setattr(target, name, copy.copy(mark))
    return target


# -- Modules: compiling in place ---------------------------------------------------------------------------
# nn.Module.compile() sets module._compiled_call_impl, which Module.__call__ runs instead of _call_impl;
# state_dict keys stay as they are (checked 2.9.1-2.13).


def install_compiled_call(module: nn.Module, call: Optional[Callable[..., Any]]) -> None:
    """Make ``module(...)`` run ``call`` (``None``: its own forward again)."""
    module._compiled_call_impl = call


def compiled_call(module: nn.Module) -> Optional[Callable[..., Any]]:
    return module.__dict__.get("_compiled_call_impl")


def call_uncompiled(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(...)`` with its hooks, without the compiled call installed on it."""
    return module._call_impl(*args, **kwargs)


def user_compiled(module: nn.Module) -> Optional[str]:
    """How the user compiled ``module`` already (``module.compile()`` / ``torch.compile(module)``), or None."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return "torch.compile(module)"
    if compiled_call(module) is not None:
        return "module.compile()"
    return None


def has_nested_compile_region() -> bool:
    """``torch.compiler.nested_compile_region`` (2.8+)."""
    return hasattr(torch.compiler, "nested_compile_region")


def is_nested_compile_region(function: Callable[..., Any]) -> bool:
    """Whether ``nested_compile_region`` marked ``function`` already (it sets ``__marked_compile_region_fn__``;
    checked 2.9.1-2.13)."""
    return hasattr(function, "__marked_compile_region_fn__")


# -- FLOPs counted during a real step ----------------------------------------------------------------------
# torch.utils.flop_counter's dispatch mode (_FlopCounterMode: its handling of higher-order ops; checked 2.13) and
# formulas (flop_registry) on a counter of our own, without FlopCounterMode's module tracker (global module hooks,
# which a compile running meanwhile would trace). A dispatch mode whose ignore_compile_internals() is True leaves
# torch.compile as it is without it: Dynamo compiles with the modes popped and its guards ignore the mode (any other
# dispatch mode makes Dynamo skip every frame it meets: "non-infra torch dispatch mode present"); compiled code then
# runs with the mode on. Checked 2.13 (CPU: eager, aot_eager, inductor; no recompile after the mode is gone).
# AOTAutograd's compiled graphs are one autograd node each, of class CompiledFunctionBackward (checked 2.13).
FLOP_TOTAL_KEY = "Global"


def flop_counting_problem() -> Optional[str]:
    """Why FLOPs cannot be counted during a compiled step on this torch (None when they can). Where Dynamo's guards
    do not know which dispatch modes compiling ignores (no ``set_is_in_mode_without_ignore_compile_internals``:
    torch 2.9.1), a tensor's guard sees the mode's Python dispatch key: every region called under the count fails
    its guards and recompiles (a shared block entry compiled once per block until the recompile limit)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        return (
            "counting FLOPs during the step needs a dispatch mode that torch.compile ignores "
            f"(TorchDispatchMode.ignore_compile_internals), which torch {torch.__version__} lacks"
        )
    if not hasattr(torch._C._dynamo.guards, "set_is_in_mode_without_ignore_compile_internals"):
        return (
            f"on torch {torch.__version__} Dynamo's guards see the counting dispatch mode, so every compiled region "
            "called during the counted step would recompile (torch 2.13 and 2.14.1 ignore it)"
        )
    return None


class FlopTally:
    """FLOPs of the ATen ops dispatched while ``mode()`` is pushed, by torch.utils.flop_counter's formulas, counted
    only while ``counting()`` is true; ``add`` counts FLOPs known otherwise. torch.compile ignores the mode.

    ``real_only``: ops on fake tensors are not counted. The mode is popped while Dynamo compiles, except under DDP,
    where Dynamo's DDPOptimizer compiles with it on and propagates fake tensors through the graph (checked 2.13)."""

    def __init__(self, counting: Callable[[], bool] = lambda: True, real_only: bool = False):
        from torch.utils.flop_counter import flop_registry

        self.counting = counting
        self.real_only = real_only
        # read by _FlopCounterMode
        self.flop_registry = dict(flop_registry) | grouped_query_attention_formulas(flop_registry)
        self.flop_counts: Dict[str, Dict[Any, int]] = defaultdict(lambda: defaultdict(int))
        self.error: Optional[BaseException] = None  # a formula that failed: the count stopped there

    def _count_flops(self, func_packet: Any, out: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Called by _FlopCounterMode for every op it ran (its higher-order ops copy and restore ``flop_counts``).
        A formula that fails stops the count instead of the user's step (``error``)."""
        formula = self.flop_registry.get(func_packet)
        if formula is None or self.error is not None or not self.counting():
            return out
        if not (self.real_only and _any_fake(args)):
            try:
                self.flop_counts[FLOP_TOTAL_KEY][func_packet] += formula(*args, **kwargs, out_val=out)
            except Exception as error:
                self.error = RuntimeError(f"FLOPs of {func_packet} not counted: {type(error).__name__}: {error}")
        return out

    def add(self, flops: int, what: str) -> None:
        self.flop_counts[FLOP_TOTAL_KEY][what] += int(flops)

    @property
    def total(self) -> int:
        return int(sum(self.flop_counts[FLOP_TOTAL_KEY].values()))

    def mode(self) -> Any:
        from torch.utils.flop_counter import _FlopCounterMode

        class _IgnoredByCompile(_FlopCounterMode):
            @classmethod
            def ignore_compile_internals(cls) -> bool:
                return True

            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                """Every op runs as it is (FlopCounterMode's own decomposes those without a formula, which would
                change the numbers of the step it counts: SiLU's backward). Higher-order ops FlopCounterMode knows
                (cond, Triton kernels) are counted as it counts them; any other runs below the mode, uncounted
                (FlopCounterMode refuses them: a nested compile region's invoke_subgraph failed the step)."""
                kwargs = kwargs or {}
                if isinstance(func, torch._ops.HigherOrderOperator):
                    handled = self._handle_higher_order_ops(func, types, args, kwargs)
                    return func(*args, **kwargs) if handled is NotImplemented else handled
                return self.counter._count_flops(func._overloadpacket, func(*args, **kwargs), args, kwargs)

        return _IgnoredByCompile(self)


# Attention ops with the heads of query, key and value at these places: (index of the query among the op's
# arguments, dimension of the heads); key and value follow the query.
_ATTENTION_HEADS = {
    "_scaled_dot_product_efficient_attention": (0, 1),
    "_scaled_dot_product_flash_attention": (0, 1),
    "_scaled_dot_product_cudnn_attention": (0, 1),
    "_scaled_dot_product_efficient_attention_backward": (1, 1),
    "_scaled_dot_product_flash_attention_backward": (1, 1),
    "_scaled_dot_product_cudnn_attention_backward": (1, 1),
    "_flash_attention_forward": (0, 2),
    "_efficient_attention_forward": (0, 2),
    "_flash_attention_backward": (1, 2),
    "_efficient_attention_backward": (1, 2),
}


def grouped_query_attention_formulas(registry: Dict[Any, Callable[..., int]]) -> Dict[Any, Callable[..., int]]:
    """``registry``'s attention formulas for keys and values with fewer heads than the query (grouped-query
    attention: Llama's, Qwen's), counted as if repeated to the query's heads, which is what the kernels compute.
    torch's own formulas assert equal heads before 2.13 (seen on 2.11's CUDA kernels); from 2.13 the count is
    theirs."""

    def repeated_heads(original: Callable[..., int], query_at: int, heads: int) -> Callable[..., int]:
        def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            args_list = list(args)
            query = args_list[query_at]
            for index in (query_at + 1, query_at + 2):  # key, value
                tensor = args_list[index]
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[heads] != query.shape[heads]:
                    shape = list(tensor.shape)
                    shape[heads] = query.shape[heads]
                    args_list[index] = torch.empty(shape, device="meta")  # the formulas read only its shape
            return original(*args_list, out_val=out_val, **kwargs)

        return formula

    formulas = {}
    for name, (query_at, heads) in _ATTENTION_HEADS.items():
        op = getattr(torch.ops.aten, name, None)
        if op is not None and op in registry:
            formulas[op] = repeated_heads(registry[op], query_at, heads)
    return formulas


def _any_fake(args: tuple) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(arg, FakeTensor) for arg in args)


def run_graph_inlining_subgraphs(graph: torch.fx.GraphModule, *args: Any) -> Any:
    """``graph(*args)``, each nested compile region's call (``invoke_subgraph``, a higher-order op that dispatch modes
    cannot run) replaced by a call of its subgraph. Checked 2.13."""
    invoke_subgraph = getattr(torch.ops.higher_order, "invoke_subgraph", None)

    class _Inlining(torch.fx.Interpreter):
        def call_function(self, target: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
            if invoke_subgraph is not None and target is invoke_subgraph:
                subgraph, _identifier, *operands = args
                return subgraph(*operands)
            return super().call_function(target, args, kwargs)

    return _Inlining(graph).run(*args)


def fake_tensor_mode() -> Any:
    """A FakeTensorMode that also takes real tensors (a graph's constants), with static shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_compiled_autograd_node(node: Any) -> bool:
    """An AOTAutograd graph's backward node (its whole compiled backward runs inside it)."""
    return type(node).__name__ == "CompiledFunctionBackward"


# -- Background compile ------------------------------------------------------------------------------------
# AOTAutograd compiles the backward with the forward under this flag (2.11+; absent in 2.9.1 and 2.10).
EAGER_BACKWARD_FLAG = "force_non_lazy_backward_lowering"


def eager_backward_lowering_problem() -> Optional[str]:
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, EAGER_BACKWARD_FLAG):
        return (
            f"needs AOTAutograd to compile backward graphs with the forward (torch._functorch.config."
            f"{EAGER_BACKWARD_FLAG}, present from torch 2.11), which torch {torch.__version__} lacks"
        )
    return None


def eager_backward_lowering() -> Any:
    import torch._functorch.config as functorch_config

    return functorch_config.patch({EAGER_BACKWARD_FLAG: True})


def outside_dispatch_modes() -> Any:
    """A context in which no ``TorchDispatchMode`` (a FLOPs count, say) sees the ops run (checked 2.9.1-2.14.1)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def warm_compile_workers() -> None:
    """Start Inductor's compile-worker pool now. Inductor starts it at its first compile, and until the pool is
    ready Triton kernels compile in the compiling thread, holding the GIL (checked 2.9.1-2.14.1). A no-op where
    the pool is not used (no Triton, one compile thread)."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def fork_compile_workers() -> bool:
    """Have Inductor fork its compile workers from this process (``worker_start_method = "fork"``) rather than from
    a sidecar process that imports torch first: on an H100 machine (torch 2.11, 16 workers) the pool was ready
    0.6 s after it was started instead of 10 s idle, 20-23 s beside a compile, and a cold regional compile of
    ConvNeXt-T, whose kernels compile one by one in the compiling thread until the pool is ready, reached its first
    step in 16.1 s instead of 20.5 s. False, changing nothing, where the user chose a start method
    (``TORCHINDUCTOR_WORKER_START``) or the pool exists already. Checked 2.9.1-2.14.1."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    if "TORCHINDUCTOR_WORKER_START" in os.environ or AsyncCompile.process_pool.cache_info().currsize:
        return False
    config.worker_start_method = "fork"
    return True


def compiler_key_functions() -> List[Callable[[], Any]]:
    """The hashes of the installation that key Inductor's caches, each computed once per process by its first
    compile or cache load: torch's sources (``codecache.torch_key``) and Triton's sources and library
    (``codecache.triton_key`` from 2.12; before, ``runtime.triton_compat.triton_key``): 0.17 s and 0.41 s of a
    new machine's first step on an H100 (2.11). Checked 2.9.1, 2.13, 2.14.1 on the CPU; 2.11 on an H100."""
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
    """Start computing ``compiler_key_functions`` in the background. From 2.12 through torch's own
    ``prefetchable_cache.prefetch`` (a caller that needs a key waits for the computation under way); before, on
    a daemon thread filling their ``functools`` caches (a caller that comes first computes it too)."""
    global _compiler_keys_prefetched
    if _compiler_keys_prefetched:
        return
    _compiler_keys_prefetched = True
    functions = compiler_key_functions()
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
    """Route ``fx_codegen_and_compile`` (Inductor's lowering of one AOT graph; checked 2.9.1-2.14.1) through
    ``_lower_in_subprocess`` on threads inside ``lowering_in_subprocess``; other threads call it as before."""
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
    thread the warning becomes the reason ``SubprocessLowerings`` keeps (checked 2.9.1-2.14.1)."""

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


TREE_CONTAINERS = "tree_manager_containers"  # CUDA-graph trees' per-thread state: device index -> container


def cudagraph_warmed_up_functions() -> int:
    """Functions CUDA-graph trees have warmed up on this thread's devices (``CUDAGraphTreeManager.
    warmed_up_functions``; checked 2.9.1-2.14.1). A compiled function runs once without a graph before it is
    recorded, and every function after it in that step runs so too; a step during which this count changes ran its
    graphs unrecorded (a new region installed by a background compile warms the whole step up): no steady step."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not (hasattr(trees.local, TREE_CONTAINERS) or torch._C._is_key_in_tls(TREE_CONTAINERS)):
        return 0  # no CUDA graph run on this thread yet (reading would create its state)
    containers = trees.get_obj(trees.local, TREE_CONTAINERS).values()
    return sum(len(c.tree_manager.warmed_up_functions) for c in containers if c.tree_manager is not None)


def import_cudagraph_trees() -> None:
    """CUDA graph trees create per-thread state on import; the thread that runs the graphs needs it (2.11)."""
    import torch._inductor.cudagraph_trees  # noqa: F401


def fx_patcher() -> type:
    """FX's tracer patches ``nn.Module.__call__`` process-wide through this class while it traces (checked
    2.9.1-2.13); the background compile confines those patches to its thread."""
    from torch.fx import _symbolic_trace

    return _symbolic_trace._Patcher


def fx_tracing_check() -> Optional[Tuple[Any, str]]:
    """(owner, name) of FX's ``is_fx_symbolic_tracing`` where it reads one process-wide flag that FX's tracer (and
    so AOTAutograd's, on a compile thread) sets while it traces (through 2.13); None where the flag is per thread
    (2.14). The function ``torch.compile`` returns checks it before each call, and refuses to run ("FX to
    symbolically trace a dynamo-optimized function") while it is true; it takes the function when
    ``torch.compile`` is called (checked 2.9.1, 2.13, 2.14.1)."""
    from torch.fx import _symbolic_trace

    return None if hasattr(_symbolic_trace, "_is_fx_tracing_tls") else (_symbolic_trace, "is_fx_symbolic_tracing")


def _set_fx_tracing_flag(value: bool) -> bool:
    """Set FX's tracing flag (this thread's from 2.14); returns the value it had."""
    from torch.fx import _symbolic_trace

    if hasattr(_symbolic_trace, "_is_fx_tracing_tls"):
        previous = _symbolic_trace._get_is_fx_tracing()
        _symbolic_trace._set_is_fx_tracing(value)
        return previous
    previous, _symbolic_trace._is_fx_tracing_flag = _symbolic_trace._is_fx_tracing_flag, value
    return previous


# torch.compiler._compile_session_context() holds torch.compiler._is_compiling_flag, which is_compiling() reads,
# True for a whole Dynamo compile (convert_frame's compile_inner enters it; checked 2.13): one flag for the process,
# so a compile on one thread makes is_compiling() true on every other. Dynamo folds the is_compiling() calls it
# traces to True without reading the flag. A torch without this context manager has no such flag to confine.
COMPILE_SESSION = "_compile_session_context"


def compile_session_owner() -> Optional[Tuple[Any, str]]:
    """(owner, name) of the context manager that sets the process-wide compiling flag, or None on a torch
    without one."""
    return (torch.compiler, COMPILE_SESSION) if hasattr(torch.compiler, COMPILE_SESSION) else None


def run_as_plain_python(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its frames never compiled by Dynamo, nor a graph broken on them: Dynamo intercepts each new
    frame under compiled code and would otherwise compile a function that a thread swapped in meanwhile (the frames
    it calls are treated as usual). Returns ``function``. Checked 2.9.1-2.14.1."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(function.__code__)
    return function


# -- Optimizers --------------------------------------------------------------------------------------------
# Optimizer.step runs the global and per-optimizer step hooks; a replacement step must run them too, set
# `_opt_called` (LR schedulers warn without it) and say whether it handles AMP scaling (checked 2.9.1-2.13).
LR_SCHEDULER_WRAPPED = "_wrapped_by_lr_sched"  # LRScheduler does not wrap a step that has this attribute


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple:
    """(pre hooks, post hooks) that ``Optimizer.step`` would run, in its order."""
    from torch.optim import optimizer as optim_module

    pre = [*optim_module._global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()]
    post = [*optimizer._optimizer_step_post_hooks.values(), *optim_module._global_optimizer_post_hooks.values()]
    return pre, post


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    optimizer._opt_called = True


def set_step_handles_amp_scaling(optimizer: torch.optim.Optimizer, handles: bool) -> None:
    """A GradScaler unscales and skips inf steps itself unless the step says it does (as fused steps do)."""
    optimizer._step_supports_amp_scaling = handles


def fused_unsupported_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why torch's fused kernel cannot run this optimizer's parameters, or None if it can."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                _device_dtype_check_for_fused(param)
    except RuntimeError as error:
        return str(error)
    return None


# -- Caches ------------------------------------------------------------------------------------------------


def fresh_inductor_cache() -> Any:
    """Empty Inductor and Triton caches for the duration (``fresh_cache``; ``fresh_inductor_cache`` before 2.10)."""
    from torch._inductor import utils

    return utils.fresh_cache() if hasattr(utils, "fresh_cache") else utils.fresh_inductor_cache()


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_<user>``); its
    ``triton/`` holds the compiled kernels unless ``TRITON_CACHE_DIR`` is set (checked 2.13 on the CPU; not yet
    run on 2.9-2.11)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# Cache layer -> (counter group, hit counter, miss counter) in torch._dynamo.utils.counters (checked 2.13; its probe
# finds the names in torch's sources, so a rename fails there).
CACHE_COUNTERS = {
    "fx_graph": ("inductor", "fxgraph_cache_hit", "fxgraph_cache_miss"),
    "aot_autograd": ("aot_autograd", "autograd_cache_hit", "autograd_cache_miss"),
}


def cache_counters() -> Dict[str, tuple]:
    """Process-wide (hits, misses) per cache layer of Inductor and AOTAutograd so far."""
    counters = torch._dynamo.utils.counters
    return {
        layer: (counters[group][hit], counters[group][miss]) for layer, (group, hit, miss) in CACHE_COUNTERS.items()
    }


# -- Precompiled functions (Dynamo's trace and the backend's code, serialized) ----------------------------
# torch.compile(fn, fullgraph=True).aot_compile(((args), kwargs)) returns an AOTCompiledFunction: guard_check(*args,
# **kwargs), .fn(*args, **kwargs) runs the compiled code; type(f).serialize(f).serialized_data and
# AOTCompiledFunction.deserialize(data, f_globals=...) move it between processes. Behind
# torch._dynamo.config.enable_aot_compile (checked 2.11 on an H100, 2.13 on the CPU). The guards are rebuilt at
# load from the grad mode and autocast state of that moment; guards on globals are left out.
AOT_COMPILE_VERSION = (2, 11)


def aot_compile_problem() -> Optional[str]:
    """Why this torch cannot serialize a compiled region (None when it can)."""
    problem = needs_torch("the precompiled cache layer (torch.compile(...).aot_compile)", AOT_COMPILE_VERSION)
    if problem is None and not hasattr(torch._dynamo, "aot_compile"):
        problem = f"the precompiled cache layer: torch {torch.__version__} has no torch._dynamo.aot_compile"
    return problem


def _serializable_guards(guards: Sequence[Any]) -> List[bool]:
    """The guards ``aot_compile`` can save: its default filter's (no guard on a global, none of a type the
    serializer refuses), also leaving out guards refused for a *derived* type, which the default keeps and the
    serializer then fails on ("ID_MATCH guard cannot be serialized", torch 2.11-2.13: a CONSTANT_MATCH on the
    ``__code__`` in a closure, as in Hugging Face's decorated ``forward`` methods). What those guards pin (the
    model's classes and code) the bundle checks itself: its key has the model's structure, and an artifact whose
    traced sources changed is never served."""
    from torch._dynamo.guards import CheckFunctionManager

    refused = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (guard.is_global or guard.guard_type in refused or refused.intersection(guard.derived_guard_types))
        for guard in guards
    ]


def aot_compile(
    function: Callable[..., Any], compile_kwargs: Dict[str, Any], args: tuple, kwargs: Dict[str, Any]
) -> Any:
    """``function`` traced whole for these inputs (no graph break allowed) and compiled, without running it."""
    compile_kwargs = {**compile_kwargs, "fullgraph": True}
    # the guard filter travels in ``options``, which torch.compile takes beside no ``mode``: the mode as its options
    mode, options = compile_kwargs.pop("mode", None), dict(compile_kwargs.pop("options", None) or {})
    if mode and mode != "default":
        options = {**inductor_mode_options(mode), **options}
    compile_kwargs["options"] = {**options, "guard_filter_fn": _serializable_guards}
    patch = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(**patch), warnings.catch_warnings():
        # building the guards reads .grad of non-leaf inputs (a block's activations), which warns on 2.13
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        return torch.compile(function, **compile_kwargs).aot_compile((args, kwargs))


def serialize_aot_compiled(compiled: Any) -> bytes:
    return type(compiled).serialize(compiled).serialized_data


def load_aot_compiled(data: bytes, f_globals: Dict[str, Any], cudagraphs: bool = False) -> Any:
    """The function ``serialize_aot_compiled`` wrote; its guards check the grad mode and autocast state of now.

    ``cudagraphs``: whether its Inductor graphs run as CUDA graphs. Loading does not take that from the options it
    was compiled with but from the process's Inductor config of the moment (``deserialize_bundled_cache_entry``,
    torch 2.11-2.14: "in precompile, we never actually call compile_fx"), so a region compiled under
    ``reduce-overhead`` loaded without CUDA graphs: on 2 x H200 its steps took 28-30 ms against 23 ms compiled.
    """
    from torch._dynamo.aot_compile import AOTCompiledFunction

    with torch._inductor.config.patch({"triton.cudagraphs": cudagraphs}):
        return AOTCompiledFunction.deserialize(data, f_globals=f_globals)


def aot_changed_sources(compiled: Any, skip: Callable[[str], bool]) -> List[str]:
    """Modules (not ``skip``-ped) whose source lines that Dynamo traced differ from the ones compiled."""
    import hashlib
    import importlib
    import inspect

    changed = []
    for source in compiled.source_info().inlined_sources:
        if skip(source.module):
            continue
        try:
            lines = inspect.getsourcelines(importlib.import_module(source.module))[0]
            text = "".join(lines[source.firstlineno - 1 : source.lastlineno - 1])
        except (ImportError, OSError, TypeError):
            text = None
        if text is None or hashlib.sha256(text.encode()).hexdigest() != source.checksum:
            changed.append(f"{source.module} (lines {source.firstlineno}-{source.lastlineno})")
    return sorted(changed)


# -- Per-block floats as graph inputs ------------------------------------------------------------------------
# Dynamo wraps a float it reads as a symbolic input only once it has seen two values of it (automatic dynamic):
# the first compile specializes, the second recompiles. Blocks sharing one entry differ in such a value by design,
# so their entry's state is primed as after a second value (torch._dynamo.pgo, 2.6-2.13: the code state per code
# object, keyed by the source's name). torch._dynamo.reset() clears it.


def float_source(argument: str, path: str) -> str:
    """Dynamo's name for the float ``path`` (``"drop_path.drop_prob"``) of the module passed as ``argument``."""
    *modules, attribute = path.split(".")
    return f"L[{argument!r}]" + "".join(f"._modules[{m!r}]" for m in modules) + f".{attribute}"


def prime_dynamic_floats(code: Any, sources: Sequence[str]) -> None:
    """Dynamo's first compile of ``code`` takes these float sources as symbolic graph inputs."""
    from torch._dynamo import pgo

    state = pgo.get_code_state()[pgo.CodeId.make(code)]
    for source in sources:
        state.automatic_dynamic[source] = pgo.FrameStateSizeEntry(scalar=pgo.auto_dynamic)


def guard_code_parts(guard: Any) -> List[str]:
    """The Python expressions a guard given to a ``guard_filter_fn`` checks (a shape-env guard's relations)."""
    return list(getattr(guard.orig_guard, "code_list", None) or [])


# -- The probes --------------------------------------------------------------------------------------------
# Each probe uses its entry as the library does and asserts what the library relies on (names, fields, texts,
# effects); it returns nothing. Compiles use the eager backend, each on a fresh code object.


@dataclass(frozen=True)
class Entry:
    name: str
    probe: Callable[[], None]  # raises when the entry is gone or changed shape; returns None


_fresh_names = itertools.count()


def _fresh(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``function`` with a code object of its own: Dynamo compiles it anew, whatever ran before."""
    return renamed_function(function, f"compat_probe_{next(_fresh_names)}_{function.__name__}")


class _CountingBackend:
    """A backend that counts the graphs Dynamo hands it and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: Any, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return graph.forward


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _double_with_break(x: torch.Tensor) -> torch.Tensor:
    x = x * 2
    torch._dynamo.graph_break()
    return x + 1


_probe_log = logging.getLogger("compile_trainer.compat.probe")


def _double_and_log(x: torch.Tensor) -> torch.Tensor:
    _probe_log.warning("traced")
    return x * 2


def _probe_callback_handler() -> None:
    handler = dynamo_callback_handler()
    seen: List[Tuple[str, str, str]] = []

    def on_start(args: Any) -> None:
        seen.append(("start", args.callback_trigger.name, str(args.compile_id)))

    def on_end(args: Any) -> None:
        seen.append(("end", args.callback_trigger.name, str(args.compile_id)))

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)
    try:
        assert on_start in handler.start_callbacks and on_end in handler.end_callbacks
        torch.compile(_fresh(_double), backend="eager")(torch.ones(2))
    finally:
        handler.remove_start_callback(on_start)
        handler.remove_end_callback(on_end)
    assert on_start not in handler.start_callbacks and on_end not in handler.end_callbacks
    assert [event[:2] for event in seen] == [("start", "DYNAMO"), ("end", "DYNAMO")], seen
    assert seen[0][2] == seen[1][2] and re.fullmatch(r"\d+/\d+", seen[0][2]), seen


def _probe_functions_closed_over() -> None:
    handler = dynamo_callback_handler()
    seen: List[Tuple[int, ...]] = []

    def on_start(args: Any) -> None:
        seen.append(functions_closed_over())

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(x: torch.Tensor) -> torch.Tensor:
            return function(x)

        return wrapper

    wrapped = [_fresh(_double), _fresh(_double)]
    first = _fresh(wrap(wrapped[0]))  # a code object of its own, then a second function sharing it
    second = types.FunctionType(first.__code__, first.__globals__, first.__name__, None, (types.CellType(wrapped[1]),))
    handler.register_start_callback(on_start)
    try:
        for function in (first, second):
            torch.compile(function, backend="eager")(torch.ones(2))
    finally:
        handler.remove_start_callback(on_start)
    assert seen == [(id(wrapped[0]),), (id(wrapped[1]),)], seen


def _probe_compilation_metrics() -> None:
    """The fields the telemetry reads: the frame (name, file, line), the compile id, a recompile's reason."""
    function = _fresh(_double)
    compiled = torch.compile(function, backend="eager", dynamic=False)
    compiled(torch.ones(2))
    first = list(compilation_metrics())[-1]
    assert first.co_name == function.__name__ and first.co_filename == __file__, first
    assert first.co_firstlineno == _double.__code__.co_firstlineno and re.fullmatch(r"\d+/0", str(first.compile_id))
    compiled(torch.ones(3))
    recompile = list(compilation_metrics())[-1]
    assert str(recompile.compile_id) == str(first.compile_id).replace("/0", "/1"), recompile.compile_id
    assert isinstance(recompile.recompile_reason, str) and "size mismatch" in recompile.recompile_reason


def _probe_grad_mode_guard() -> None:
    """A recompile for another grad mode is told apart by its reason's text (validation under no_grad)."""
    compiled = torch.compile(_fresh(_double), backend="eager")
    compiled(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        compiled(torch.ones(2, requires_grad=True))
    reason = list(compilation_metrics())[-1].recompile_reason
    assert GRAD_MODE_GUARD in reason, reason


def _probe_requires_grad_guard() -> None:
    """A recompile for an input that requires grad where the graph's did not is told apart by its reason's text
    (the first block of a stack fed the batch, the later ones activations)."""
    compiled = torch.compile(_fresh(_double), backend="eager")
    compiled(torch.ones(2))
    compiled(torch.ones(2, requires_grad=True))
    reason = re.sub(r"^\d+/\d+:\s*", "", list(compilation_metrics())[-1].recompile_reason)
    assert REQUIRES_GRAD_GUARD.match(reason), reason


def _probe_recompile_limit() -> None:
    """The limit is Dynamo's setting, and a frame past it is reported with a text ``is_recompile_limit`` knows."""
    assert isinstance(recompile_limit(), int) and recompile_limit() >= 1
    previous = set_recompile_limit(1)
    try:
        assert recompile_limit() == 1 == torch._dynamo.config.recompile_limit
        backend = _CountingBackend()
        compiled = torch.compile(_fresh(_double), backend=backend, dynamic=False)
        compiled(torch.ones(2))
        compiled(torch.ones(3))  # over the limit: runs eagerly, not compiled
        assert backend.graphs == 1
        failed = list(compilation_metrics())[-1]
        assert failed.fail_type and is_recompile_limit(str(failed.fail_reason)), failed.fail_reason
    finally:
        assert set_recompile_limit(previous) == 1
    assert recompile_limit() == previous


def _probe_fail_on_recompile() -> None:
    compiled = torch.compile(_fresh(_double), backend="eager", dynamic=False)
    compiled(torch.ones(2))
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled(torch.ones(3))
    except RuntimeError as error:
        assert is_fail_on_recompile(error), str(error)
    else:
        raise AssertionError("set_stance('fail_on_recompile') let a recompile through")


def _probe_traced_error_summary() -> None:
    def unpack(x: torch.Tensor, pair: Any = None) -> torch.Tensor:
        first, second = pair
        return x * first

    try:
        torch.compile(unpack, backend="eager", fullgraph=True)(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the error is what is probed
        summary = traced_error_summary(error)
    else:
        raise AssertionError("unpacking None compiled")
    assert re.search(r" at compat\.py:\d+ `first, second = pair`$", summary), summary
    assert traced_error_summary(TypeError("forward() missing 1 required positional argument: 'gate'")) == (
        "TypeError: forward() missing 1 required positional argument: 'gate'"
    )

    def fails(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise RuntimeError("this backend compiles nothing")

    try:
        torch.compile(lambda x: x.sin(), backend=fails)(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the error is what is probed
        summary = traced_error_summary(error)
    assert summary.endswith("raised: RuntimeError: this backend compiles nothing"), summary


def _probe_graph_breaks() -> None:
    """A graph break adds a reason with its user stack, and each graph counts in ``unique_graphs``."""
    reasons, graphs = len(graph_break_reasons()), unique_graphs()
    torch.compile(_fresh(_double_with_break), backend="eager")(torch.ones(2))
    added = graph_break_reasons()[reasons:]
    assert added and isinstance(added[-1].reason, str) and isinstance(list(added[-1].user_stack), list), added
    assert unique_graphs() - graphs == 2, "one graph before the break, one after"


def _probe_cudagraph_skips() -> None:
    """A counter that never moves on the CPU: its name must be the one Inductor increments."""
    import inspect

    from torch._inductor import cudagraph_utils

    assert isinstance(cudagraph_skips(), int)
    assert 'counters["inductor"]["cudagraph_skips"]' in inspect.getsource(cudagraph_utils)


def _probe_compiler_collectives() -> None:
    previous = set_compiler_collectives(True)
    try:
        assert compiler_collectives() is True and torch._dynamo.config.enable_compiler_collectives is True
    finally:
        assert set_compiler_collectives(previous) is True
    assert compiler_collectives() is previous


def _probe_ddp_optimizer() -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert DistributedDataParallel._get_active_ddp_module() is None
    previous = torch._dynamo.config.optimize_ddp
    try:
        set_optimize_ddp(True)
        assert ddp_optimizer_on() is True
        assert turn_off_ddp_optimizer() is True and ddp_optimizer_on() is False
        set_optimize_ddp("python_reducer")
        assert turn_off_ddp_optimizer() == "python_reducer" and torch._dynamo.config.optimize_ddp == "python_reducer"
    finally:
        set_optimize_ddp(previous)


def _probe_ignored_logger_methods() -> None:
    """A logger method in the set is dropped from traced code (no graph break), and Dynamo can still log its config."""
    previous = set_ignored_logger_methods(ignored_logger_methods() | {logging.Logger.warning})
    try:
        assert logging.Logger.warning in ignored_logger_methods()
        assert dynamo_config_loggable(), "the ignore set breaks every compile's metrics"
        compiled = torch.compile(_fresh(_double_and_log), backend="eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        set_ignored_logger_methods(previous)
    assert ignored_logger_methods() == previous


def _probe_backends() -> None:
    assert {"inductor", "eager", "aot_eager"} <= set(list_backends())
    backend = lookup_backend("eager")
    assert torch.equal(torch.compile(_fresh(_double), backend=backend)(torch.ones(2)), torch.full((2,), 2.0))


def _probe_inductor_backend() -> None:
    """The object torch.compile builds for Inductor: the mode's and the given options applied, and equal settings
    equal (Dynamo reuses a cache entry only under an equal backend). Not compiled: 10-40 s on a CPU."""
    backend = inductor_backend("max-autotune-no-cudagraphs", {"epilogue_fusion": False}, None)
    assert callable(backend) and backend.config.get("max_autotune") is True, backend.config
    assert backend.config.get("epilogue_fusion") is False
    assert backend == inductor_backend("max-autotune-no-cudagraphs", {"epilogue_fusion": False}, None)
    assert inductor_mode_options("max-autotune").get("max_autotune") is True
    assert inductor_mode_options("reduce-overhead").get("triton.cudagraphs") is True


def _probe_inductor_options() -> None:
    """Every option returned is one Inductor's config takes (a renamed one fails when the patch is entered)."""
    options = inductor_options_without_size_guards()
    assert isinstance(options, dict)
    with torch._inductor.config.patch(options):
        for name, value in options.items():
            owner = torch._inductor.config
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            assert getattr(owner, name.split(".")[-1]) == value, name


def _probe_mark_dynamic() -> None:
    """A marked dimension compiles one graph for every size in range; the marks travel with a tensor's copy."""
    for mark in (lambda t: mark_dynamic(t, 1, min=2, max=8), lambda t: maybe_mark_dynamic(t, [1])):
        backend = _CountingBackend()
        compiled = torch.compile(_fresh(_double), backend=backend)
        for length in (3, 4, 5):
            marked = torch.zeros(2, length)
            mark(marked)
            compiled(copy_dynamo_marks(marked, torch.zeros(2, length)))
        assert backend.graphs == 1, f"{backend.graphs} graphs for 3 lengths of a dynamic dimension"


def _probe_mark_static_address() -> None:
    tensor = torch.zeros(2)
    mark_static_address(tensor)
    assert getattr(tensor, "_dynamo_static_input_type", None) == "unguarded"
    assert getattr(copy_dynamo_marks(tensor, torch.zeros(2)), "_dynamo_static_input_type", None) == "unguarded"


def _probe_compiled_call() -> None:
    module = nn.Linear(2, 2)
    install_compiled_call(module, lambda x: x * 0)
    assert compiled_call(module) is not None
    assert torch.equal(module(torch.ones(1, 2)), torch.zeros(1, 2)), "Module.__call__ ignores _compiled_call_impl"
    assert user_compiled(module) == "module.compile()"
    assert call_uncompiled(module, torch.ones(1, 2)).shape == (1, 2)
    install_compiled_call(module, None)
    assert compiled_call(module) is None
    assert user_compiled(module) is None and user_compiled(torch.compile(module)) == "torch.compile(module)"


def _probe_fx_tracing_check() -> None:
    """The check that the compiled function captures: with the flag set, one made under a blind check runs (and
    compiles), one made under FX's own refuses; where the flag is per thread, another thread's does not count."""
    from torch.fx import _symbolic_trace

    check = fx_tracing_check()
    blind = None
    if check is not None:
        owner, name = check
        original = getattr(owner, name)
        try:
            setattr(owner, name, lambda: False)
            blind = torch.compile(lambda x: x + 1, backend="eager")
        finally:
            setattr(owner, name, original)
    else:
        seen: List[bool] = []
        other = threading.Thread(
            target=lambda: (_set_fx_tracing_flag(True), seen.append(_symbolic_trace.is_fx_tracing()))
        )
        other.start()
        other.join()
        assert seen == [True] and not _symbolic_trace.is_fx_tracing(), "another thread's flag is its own"
    plain = torch.compile(lambda x: x + 2, backend="eager")
    previous = _set_fx_tracing_flag(True)
    try:
        assert _symbolic_trace.is_fx_symbolic_tracing(), "the flag is what the check reads"
        if blind is not None:
            assert torch.equal(blind(torch.ones(1)), torch.full((1,), 2.0))
        try:
            plain(torch.ones(1))
            refused = False
        except RuntimeError as error:
            refused = "symbolically trace" in str(error)
        assert refused, "a compiled function refuses to run while FX traces"
    finally:
        _set_fx_tracing_flag(previous)


def _probe_fx_patcher() -> None:
    """FX's tracer patches ``nn.Module.__call__`` through ``_Patcher.patch_method(cls, name, new_fn, ...)``."""
    patcher = fx_patcher()
    original = patcher.patch_method
    patched = []

    def recording(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        patched.append((cls, name))
        return original(self, cls, name, new_fn, deduplicate)

    patcher.patch_method = recording
    try:
        torch.fx.symbolic_trace(nn.Linear(2, 2))
    finally:
        patcher.patch_method = original
    assert (nn.Module, "__call__") in patched, patched


def _probe_compile_session() -> None:
    owner = compile_session_owner()
    if owner is None:
        return
    with getattr(*owner)():
        assert torch.compiler.is_compiling(), "is_compiling() no longer reads the compile session's flag"
    assert not torch.compiler.is_compiling()


def _call_module(module: torch.nn.Module, *args: Any) -> Any:
    return torch.nn.Module.__call__(module, *args)


def _frames_compiled_past_a_break(call: Callable[..., Any]) -> int:
    """Dynamo compiles of one call of a compiled module that calls its part through ``call``, a ``__call__`` as a
    thread swaps one in, past the break at the part's disabled forward."""

    class Part(torch.nn.Module):
        __call__ = call

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class Around(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.part = Part()
            self.part.forward = torch.compiler.disable(self.part.forward)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.part(x * 2)

    starts: List[Any] = []
    handler = dynamo_callback_handler()
    handler.register_start_callback(starts.append)
    try:
        assert torch.compile(Around(), backend=_CountingBackend())(torch.ones(2)).tolist() == [3.0, 3.0]
    finally:
        handler.remove_start_callback(starts.append)
    return len(starts)


def _probe_run_as_plain_python() -> None:
    compiled = _frames_compiled_past_a_break(_fresh(_call_module))
    plain = _frames_compiled_past_a_break(run_as_plain_python(_fresh(_call_module)))
    assert plain == compiled - 1, f"the swapped-in __call__'s frame: {compiled} compiles unmarked, {plain} marked"


def _probe_loop_break_reports() -> None:
    reported, version = reports_frames_run_eagerly_at_a_loop_break(), torch_version()
    if version[:2] in ((2, 9), (2, 13), (2, 14)):  # the versions it was checked on
        assert reported == (version >= (2, 13)), f"torch {torch.__version__}: reported={reported}"


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


def _probe_optimizer() -> None:
    """The hooks a replacement step runs, and the attributes LR schedulers and GradScaler read."""
    import inspect

    from torch.amp import grad_scaler
    from torch.optim import lr_scheduler
    from torch.optim import optimizer as optim_module

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    hooks = [
        optimizer.register_step_pre_hook(lambda *args: None),
        optimizer.register_step_post_hook(lambda *args: None),
        optim_module.register_optimizer_step_pre_hook(lambda *args: None),
        optim_module.register_optimizer_step_post_hook(lambda *args: None),
    ]
    try:
        pre, post = optimizer_step_hooks(optimizer)
        assert len(pre) == len(post) == 2, (pre, post)
    finally:
        for handle in hooks:
            handle.remove()
    assert optimizer_step_hooks(optimizer) == ([], [])

    def step(closure: Any = None) -> None:
        mark_optimizer_stepped(optimizer)

    setattr(step, LR_SCHEDULER_WRAPPED, True)
    optimizer.step = step
    scheduler = lr_scheduler.StepLR(optimizer, step_size=1)
    assert optimizer.step is step, "LRScheduler wrapped a step marked as wrapped"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of lr_scheduler.step() before optimizer.step()"
        optimizer.step()
        scheduler.step()
    set_step_handles_amp_scaling(optimizer, False)
    assert '"_step_supports_amp_scaling"' in inspect.getsource(grad_scaler)
    assert fused_unsupported_reason(optimizer) is None
    half = torch.optim.SGD([nn.Parameter(torch.zeros(1, dtype=torch.float64))], lr=0.1)
    assert fused_unsupported_reason(half) is None or isinstance(fused_unsupported_reason(half), str)


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
    for group, hit, miss in CACHE_COUNTERS.values():
        assert f'counters["{group}"]["{hit}"]' in sources and f'counters["{group}"]["{miss}"]' in sources, (hit, miss)
    counts = cache_counters()
    assert set(counts) == set(CACHE_COUNTERS) and all(isinstance(n, int) for pair in counts.values() for n in pair)


def _probe_eager_backward_lowering() -> None:
    import torch._functorch.config as functorch_config

    assert eager_backward_lowering_problem() is None
    before = getattr(functorch_config, EAGER_BACKWARD_FLAG)
    with eager_backward_lowering():
        assert getattr(functorch_config, EAGER_BACKWARD_FLAG) is True
    assert getattr(functorch_config, EAGER_BACKWARD_FLAG) == before


def _probe_outside_dispatch_modes() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops: List[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
        with outside_dispatch_modes():
            torch.ones(2) * 3
        seen = len(Seen.ops)
        torch.ones(2) - 1
    assert seen == 2 and len(Seen.ops) == 4, Seen.ops


def _probe_prefetch_compiler_keys() -> None:
    functions = compiler_key_functions()
    assert functions and all(callable(function) for function in functions)
    prefetch_compiler_keys()
    keys = [function() for function in functions]  # waits for (or repeats) the prefetch: the same values
    assert isinstance(keys[0], bytes) and keys == [function() for function in functions]


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


def _probe_nested_compile_region() -> None:
    assert has_nested_compile_region()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert not is_nested_compile_region(forward)
    assert is_nested_compile_region(torch.compiler.nested_compile_region(forward))


def _probe_dynamic_floats() -> None:
    """Two modules that differ in a float share one graph when the entry is primed."""
    from torch._dynamo.testing import CompileCounter

    def entry(module, x):
        return x * module.scale

    counter, seen = CompileCounter(), []
    function = renamed_function(entry, "compat_probe_floats")
    code = function.__code__
    prime_dynamic_floats(code, [float_source("module", "scale")])
    for scale in (0.5, 0.25):
        module = nn.Module()
        module.scale = scale

        def watch(guards):
            seen.extend(part for guard in guards for part in guard_code_parts(guard))
            return [True] * len(guards)

        compiled = torch.compile(function, backend=counter, options={"guard_filter_fn": watch})
        assert torch.equal(compiled(module, torch.ones(2)), torch.full((2,), scale))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two values of a primed float"
    assert any("L['module'].scale" in part for part in seen), seen


def _probe_aot_compile() -> None:
    assert aot_compile_problem() is None
    compiled = aot_compile(_fresh(_double), {"backend": "eager"}, (torch.ones(2),), {})
    assert compiled.guard_check(torch.ones(2)) and not compiled.guard_check(torch.ones(3))
    assert torch.equal(compiled.fn(torch.ones(2)), torch.full((2,), 2.0))
    assert aot_changed_sources(compiled, lambda name: False) == []
    loaded = load_aot_compiled(serialize_aot_compiled(compiled), f_globals=globals())
    assert loaded.guard_check(torch.ones(2)) and torch.equal(loaded.fn(torch.ones(2)), torch.full((2,), 2.0))
    import inspect

    from torch._functorch._aot_autograd import aot_autograd_result

    # what load_aot_compiled patches: loading reads CUDA graphs from the Inductor config of the moment
    assert "config.triton.cudagraphs" in inspect.getsource(aot_autograd_result.deserialize_bundled_cache_entry)


def _probe_flop_tally() -> None:
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x @ weight).relu()

    compiled = torch.compile(block, backend="aot_eager")
    x, weight = torch.ones(2, 3), torch.ones(3, 4, requires_grad=True)
    tally = FlopTally()
    graphs = unique_graphs()
    with tally.mode():
        out = compiled(x, weight)
    assert unique_graphs() == graphs + 1, "a FlopTally's mode made Dynamo skip the frame"
    assert tally.total == 2 * 2 * 3 * 4, tally.total
    assert is_compiled_autograd_node(out.grad_fn), type(out.grad_fn).__name__
    with tally.mode():
        compiled(x, weight)  # the same call again: its guards pass, or (the problem named) they see the mode
    recompiled = unique_graphs() != graphs + 1
    assert recompiled == (flop_counting_problem() is not None), flop_counting_problem()
    fake = fake_tensor_mode()
    with fake:
        product = fake.from_tensor(torch.ones(2, 3)) @ torch.ones(3, 4)  # a real tensor is taken in
    assert product.shape == (2, 4) and type(product).__name__ == "FakeTensor"
    from torch.utils.flop_counter import flop_registry

    attention = torch.ops.aten._scaled_dot_product_efficient_attention  # grouped-query: 8 query heads, 2 KV heads
    query, grouped = torch.empty(2, 8, 16, 32, device="meta"), torch.empty(2, 2, 16, 32, device="meta")
    formula = grouped_query_attention_formulas(flop_registry)[attention]
    assert formula(query, grouped, grouped, None, False, out_val=None) == formula(query, query, query, None, False) > 0
    graph = torch.fx.symbolic_trace(lambda a, b: (a @ b).relu())
    assert torch.equal(run_graph_inlining_subgraphs(graph, x, weight.detach()), block(x, weight.detach()))


ENTRIES = [
    Entry("dynamo_callback_handler", _probe_callback_handler),
    Entry("compilation_metrics", _probe_compilation_metrics),
    Entry("functions_closed_over", _probe_functions_closed_over),
    Entry("GRAD_MODE_GUARD", _probe_grad_mode_guard),
    Entry("REQUIRES_GRAD_GUARD", _probe_requires_grad_guard),
    Entry("recompile_limit", _probe_recompile_limit),
    Entry("is_fail_on_recompile", _probe_fail_on_recompile),
    Entry("traced_error_summary", _probe_traced_error_summary),
    Entry("reports_frames_run_eagerly_at_a_loop_break", _probe_loop_break_reports),
    Entry("graph_break_reasons", _probe_graph_breaks),
    Entry("cudagraph_skips", _probe_cudagraph_skips),
    Entry("set_compiler_collectives", _probe_compiler_collectives),
    Entry("turn_off_ddp_optimizer", _probe_ddp_optimizer),
    Entry("set_ignored_logger_methods", _probe_ignored_logger_methods),
    Entry("backends", _probe_backends),
    Entry("inductor_backend", _probe_inductor_backend),
    Entry("inductor_options_without_size_guards", _probe_inductor_options),
    Entry("mark_dynamic", _probe_mark_dynamic),
    Entry("mark_static_address", _probe_mark_static_address),
    Entry("compiled_call", _probe_compiled_call),
    Entry("fx_patcher", _probe_fx_patcher),
    Entry("fx_tracing_check", _probe_fx_tracing_check),
    Entry("compile_session_owner", _probe_compile_session),
    Entry("run_as_plain_python", _probe_run_as_plain_python),
    Entry("import_cudagraph_trees", _probe_cudagraph_trees),
    Entry("cudagraph_warmed_up_functions", _probe_cudagraph_warmups),
    Entry("warm_compile_workers", _probe_warm_compile_workers),
    Entry("fork_compile_workers", _probe_fork_compile_workers),
    Entry("prefetch_compiler_keys", _probe_prefetch_compiler_keys),
    Entry("lowering_in_subprocess", _probe_lowering_in_subprocess),
    Entry("outside_dispatch_modes", _probe_outside_dispatch_modes),
    Entry("optimizer internals", _probe_optimizer),
    Entry("inductor_cache_dir", _probe_inductor_cache_dir),
    Entry("cache_counters", _probe_cache_counters),
    Entry("prime_dynamic_floats", _probe_dynamic_floats),
    Entry("FlopTally", _probe_flop_tally),
]
# Present from the version named: probed only there.
VERSIONED_ENTRIES = [
    (Entry("eager_backward_lowering", _probe_eager_backward_lowering), (2, 11)),
    (Entry("nested_compile_region", _probe_nested_compile_region), (2, 8)),
    (Entry("aot_compile", _probe_aot_compile), AOT_COMPILE_VERSION),
]
