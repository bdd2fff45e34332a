"""FLOPs counted during a real step: torch's flop counter as a dispatch mode that torch.compile ignores, the graphs
run on fake tensors, AOTAutograd's backward nodes, and a context no dispatch mode sees.

torch.utils.flop_counter's dispatch mode (_FlopCounterMode: its handling of higher-order ops) and formulas run on a
counter of our own, without FlopCounterMode's module tracker (global module hooks, which a compile running meanwhile
would trace). A dispatch mode whose ignore_compile_internals() is True leaves torch.compile as it is without it:
Dynamo compiles with the modes popped and its guards ignore the mode (any other dispatch mode makes Dynamo skip every
frame it meets: "non-infra torch dispatch mode present"); compiled code then runs with the mode on (CPU: eager,
aot_eager, inductor; no recompile after the mode is gone). AOTAutograd's compiled graphs are one autograd node
each, of class CompiledFunctionBackward."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from .dynamo_events import unique_graphs
from .entry import Entry, Obsolete

__all__ = [
    "ENTRIES",
    "FlopTally",
    "fake_tensor_mode",
    "flop_counting_problem",
    "is_compiled_autograd_node",
    "outside_dispatch_modes",
    "run_graph_inlining_subgraphs",
]

_FLOP_TOTAL_KEY = "Global"


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
    """FLOPs of the ATen ops dispatched while ``mode()`` is pushed, by ``formulas`` (an op's overload packet ->
    its formula; torch.utils.flop_counter's ``flop_registry`` by default), counted only while ``counting()`` is
    true; ``add`` counts FLOPs known otherwise. torch.compile ignores the mode.

    ``real_only``: ops on fake tensors are not counted. The mode is popped while Dynamo compiles, except under DDP,
    where Dynamo's DDPOptimizer compiles with it on and propagates fake tensors through the graph."""

    def __init__(
        self,
        counting: Callable[[], bool] = lambda: True,
        real_only: bool = False,
        formulas: Optional[Mapping[Any, Callable[..., int]]] = None,
    ):
        from torch.utils.flop_counter import flop_registry

        self.counting = counting
        self.real_only = real_only
        self.flop_registry = dict(flop_registry if formulas is None else formulas)  # read by _FlopCounterMode
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
                self.flop_counts[_FLOP_TOTAL_KEY][func_packet] += formula(*args, **kwargs, out_val=out)
            except Exception as error:
                self.error = RuntimeError(f"FLOPs of {func_packet} not counted: {type(error).__name__}: {error}")
        return out

    def add(self, flops: int, what: str) -> None:
        self.flop_counts[_FLOP_TOTAL_KEY][what] += int(flops)

    @property
    def total(self) -> int:
        return int(sum(self.flop_counts[_FLOP_TOTAL_KEY].values()))

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


def _any_fake(args: tuple) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(arg, FakeTensor) for arg in args)


def run_graph_inlining_subgraphs(graph: torch.fx.GraphModule, *args: Any) -> Any:
    """``graph(*args)``, each nested compile region's call (``invoke_subgraph``, a higher-order op that dispatch modes
    cannot run) replaced by a call of its subgraph."""
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


def outside_dispatch_modes() -> Any:
    """A context in which no ``TorchDispatchMode`` (a FLOPs count, say) sees the ops run."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# -- The probes --------------------------------------------------------------------------------------------


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
    graph = torch.fx.symbolic_trace(lambda a, b: (a @ b).relu())
    assert torch.equal(run_graph_inlining_subgraphs(graph, x, weight.detach()), block(x, weight.detach()))


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


ENTRIES = [
    Entry(
        "FlopTally",
        _probe_flop_tally,
        reaches=(
            "torch.utils.flop_counter._FlopCounterMode",
            "torch.utils.flop_counter.flop_registry",
            "torch.utils._python_dispatch.TorchDispatchMode.ignore_compile_internals",
            "torch._C._dynamo.guards.set_is_in_mode_without_ignore_compile_internals",
            "torch._subclasses.fake_tensor.FakeTensorMode",
            "torch.ops.higher_order.invoke_subgraph",
        ),
        checked=("2.9.1", "2.13", "2.14.1"),
        upstream=(
            "https://github.com/pytorch/pytorch/pull/161648",
            "https://github.com/pytorch/pytorch/pull/164992",
            "https://github.com/pytorch/pytorch/pull/177169",
        ),
        obsolete=(
            Obsolete(
                (2, 13),
                "telemetry/flops.py's grouped_query_attention_formulas: torch's own attention formulas count "
                "grouped-query attention from 2.13 (they asserted equal heads before)",
            ),
        ),
    ),
    Entry(
        "outside_dispatch_modes",
        _probe_outside_dispatch_modes,
        reaches=("torch.utils._python_dispatch._disable_current_modes",),
        checked=("2.9.1", "2.14.1"),
    ),
]
