"""FLOPs of one training step, counted while the step itself runs: no user code runs for the count.

``StepFlopCount`` is started before a step and finished after its backward (in Lightning: the first training
batch, from ``on_train_batch_start`` to ``on_before_optimizer_step``). Meanwhile:

- **Eager code** (everything outside compiled graphs: a ``none`` policy, the parts a policy leaves eager, the code
  between graph breaks, and the backward of eager code) is counted op by op by ``torch.utils.flop_counter``'s
  formulas (``step_formulas``: with grouped-query attention), through a dispatch mode that ``torch.compile``
  ignores (``compat.FlopTally``): Dynamo compiles and guards as it would without it, so the step compiles what it
  would have compiled and nothing more.
- **Each call of a compiled graph** (``compiling.backends.observing_graph_calls``) is counted from the graph
  itself: the FX graph Dynamo gave the backend, run forward and backward on fake tensors shaped like the call's
  inputs (no data, no kernels, no random numbers), once per graph and input shapes. Whatever the backend made of
  it (Inductor's own matmul kernels, CUDA graphs) the count is the graph's. While the compiled forward runs the
  eager count pauses; the backward is AOTAutograd's one node per graph, which pauses the eager count while it
  runs and adds the graph's backward FLOPs (a backend without AOTAutograd, such as ``eager``, leaves ordinary
  autograd nodes, counted as eager code).

Graphs run from elsewhere than a region's backend (the compile cache's precompiled artifacts, a model's own
``torch.compile``) are counted by the ATen ops their compiled code dispatches: Inductor's calls to matmul,
convolution and attention kernels, but not kernels it generates itself (``max-autotune`` templates).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from compile_trainer import compat
from compile_trainer.compiling.backends import observing_graph_calls

GraphFlops = Tuple[int, int]  # forward, backward
Formulas = Dict[Any, Callable[..., int]]  # an op's overload packet -> its FLOPs formula

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


def grouped_query_attention_formulas(registry: Formulas) -> Formulas:
    """``registry``'s attention formulas for keys and values with fewer heads than the query (grouped-query
    attention: Llama's, Qwen's), counted as if repeated to the query's heads, which is what the kernels compute.
    torch's own formulas assert equal heads before 2.13 (seen on 2.11's CUDA kernels); from 2.13 the count is
    theirs (compat's ``FlopTally`` entry says when this goes)."""

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


def step_formulas() -> Formulas:
    """The formulas a step is counted by: torch.utils.flop_counter's, its attention taking grouped-query attention."""
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry) | grouped_query_attention_formulas(flop_registry)


def _signature(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """What a graph's FLOPs depend on: its inputs' shapes and which need gradients (and any plain value)."""
    return tuple(
        (tuple(a.shape), a.dtype, a.device, a.requires_grad)
        if isinstance(a, torch.Tensor)
        else (a if isinstance(a, (int, float, bool, str, type(None))) else id(a))
        for a in args
    )


def step_signature(batch: Any, training_step: Callable[..., Any]) -> str:
    """What a step's FLOPs depend on besides the model: its batch's tensor shapes and dtypes (other values by type)
    and the code of ``training_step``. Two steps of one model with the same signature count the same FLOPs."""
    leaves = [
        f"{tuple(leaf.shape)}:{leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        for leaf in tree_leaves(batch)
    ]
    code = getattr(training_step, "__code__", None)
    digest = hashlib.sha256(code.co_code + repr(code.co_consts).encode() if code is not None else b"").hexdigest()
    return f"{','.join(leaves)}|{getattr(training_step, '__qualname__', '')}:{digest[:16]}"


def graph_flops(graph: torch.fx.GraphModule, args: Tuple[Any, ...]) -> GraphFlops:
    """FLOPs of ``graph``'s forward on inputs shaped like ``args``, and of its backward (gradients of every
    differentiable output, for every input and parameter that requires them), on fake tensors."""
    fake = compat.fake_tensor_mode()
    inputs = [fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted += [fake.from_tensor(p) for p in graph.parameters() if p.requires_grad]
    forward = compat.FlopTally(formulas=step_formulas())
    with fake, forward.mode():
        outputs = compat.run_graph_inlining_subgraphs(graph, *inputs)
    differentiable = [o for o in tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    backward = compat.FlopTally(formulas=step_formulas())
    if differentiable and wanted:
        with fake, backward.mode():
            grads = [torch.ones_like(o) for o in differentiable]
            torch.autograd.grad(differentiable, wanted, grads, allow_unused=True)
    return forward.total, backward.total


def _compiled_nodes(outputs: Any, before: Set[Any]) -> List[Any]:
    """The AOTAutograd nodes that produced ``outputs``, found walking back from them and stopping at the nodes
    the call's inputs had (``before``): an output that is a view of the graph's result hangs below its node."""
    found, seen = [], set()
    pending = [o.grad_fn for o in tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None or node in seen or node in before:
            continue
        seen.add(node)
        if compat.is_compiled_autograd_node(node):
            found.append(node)
        else:
            pending.extend(next_node for next_node, _ in node.next_functions)
    return found


class StepFlopCount:
    """Counts the FLOPs of what runs between ``start()`` and ``finish()`` on this thread (see the module's doc).

    ``finish()`` returns the count, or raises what made it impossible (a graph that cannot run on fake tensors, a
    formula that failed on an op of the step). Neither fails the step itself.
    """

    def __init__(self) -> None:
        self._paused = threading.local()  # per thread: the backward of a CUDA step runs on the device's thread
        # Not while anything compiles: under DDP, Dynamo compiles (Inductor autotunes on real tensors) with the mode on.
        self.tally = compat.FlopTally(
            counting=lambda: not getattr(self._paused, "depth", 0) and not torch.compiler.is_compiling(),
            real_only=True,
            formulas=step_formulas(),
        )
        self._graphs: Dict[Tuple[int, Tuple[Any, ...]], GraphFlops] = {}
        self._mode: Optional[Any] = None
        self._observing: Optional[Any] = None
        self._error: Optional[BaseException] = None
        self.graph_calls = 0  # compiled-graph calls counted from their graphs

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        self._mode = self.tally.mode()
        self._mode.__enter__()
        self._observing = observing_graph_calls(self._observe)
        self._observing.__enter__()

    def finish(self) -> int:
        """End the count (idempotent); the FLOPs counted."""
        self._end()
        error = self._error or self.tally.error
        if error is not None:
            raise error
        return self.tally.total

    def abort(self) -> None:
        """End the count without a result (the step failed)."""
        self._end()

    def _end(self) -> None:
        if self._mode is None:
            return
        self._observing.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        self._mode = self._observing = None

    # -- the compiled graphs ----------------------------------------------------------------------------

    def _pause(self) -> None:
        self._paused.depth = getattr(self._paused, "depth", 0) + 1

    def _resume(self) -> None:
        self._paused.depth -= 1

    def _observe(self, graph: torch.fx.GraphModule, compiled: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
        before = {a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
        self._pause()
        try:
            flops = self._flops_of(graph, args)
            outputs = compiled(*args)
        finally:
            self._resume()
        if flops is None:
            return outputs
        forward, backward = flops
        self.tally.add(forward, "compiled graphs (forward)")
        self.graph_calls += 1
        for node in _compiled_nodes(outputs, before):
            node.register_prehook(self._backward_hook(backward))
            node.register_hook(self._after_backward)
        return outputs

    def _flops_of(self, graph: torch.fx.GraphModule, args: Tuple[Any, ...]) -> Optional[GraphFlops]:
        key = (id(graph), _signature(args))
        if key not in self._graphs:
            try:
                self._graphs[key] = graph_flops(graph, args)
            except Exception as error:  # data-dependent ops without a fake implementation, ...
                self._error = self._error or error
                return None
        return self._graphs[key]

    def _backward_hook(self, flops: int) -> Callable[..., None]:
        def before_backward(grad_outputs: Any) -> None:
            self._pause()
            if self.active:
                self.tally.add(flops, "compiled graphs (backward)")

        return before_backward

    def _after_backward(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._resume()
