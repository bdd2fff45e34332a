"""Blocks handed a lower-precision input than their siblings: upcast it where the block promotes it anyway.

Under autocast a stage of a CNN or of a hierarchical transformer often hands its first block a bfloat16 activation
(a downsampling convolution's output) and every other block the float32 output of the block before it (the
residual sum promotes). Blocks that share one compiled entry then compile it once per input dtype: in timm's
ConvNeXt-T, 3 of the 7 graphs and about a third of the regional compile (H200, 2026-11-26).

``PromotedInputs`` (an interceptor at ``region_call.PROMOTE_INPUTS``) decides once per shared entry, at its first
call under autocast. If that call has a bfloat16 or float16 floating input, it runs eagerly (it is the step's own
computation, run once), and where every floating output is float32 the block's ``forward`` runs once more, without
gradients, on the inputs upcast to float32: same random-number state, its buffers restored after, the FLOPs count
and any other dispatch mode off (the block's own code once more, once per shared entry; not where the block or a
module in it has forward hooks, which that call would skip). Outputs equal bit for bit: from then on, under
autocast, such inputs are upcast before the call, so the entry compiles for float32 only. Otherwise, or if the
check raises, calls go on as they come (a graph per dtype). The upcast changes nothing in the forward (checked on
the call itself); in the backward the input's gradient is summed in float32 and rounded once, where eager
autograd sums it in the input's dtype.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from compile_trainer import compat
from compile_trainer.compiling import region_call

log = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _low_precision(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION


def _upcast(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.float() if _low_precision(t) else t, tree)


def _floating(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class PromotedInputs:
    """Interceptor: per shared entry, whether its lower-precision inputs are upcast to float32 (module's doc)."""

    position = region_call.PROMOTE_INPUTS
    replaces_compiled = False

    def __init__(self, shared: Callable[[str], bool], on_upcast: Callable[[str], None] = lambda name: None) -> None:
        # Whether blocks share an entry, asked when the entry is first called: entries are re-keyed by value when
        # the compiler specializes one (``regions._split_by_value``), before the moved blocks' first call.
        self.shared = shared
        self.upcast: Dict[str, bool] = {}  # entry key -> decided: upcast its lower-precision inputs
        self.on_upcast = on_upcast  # told the region's name where an entry's inputs are upcast from now on

    def __call__(self, item: Any, proceed: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        decided = self.upcast.get(item.entry_key)
        if decided is False or not _any_autocast():
            return proceed(*args, **kwargs)
        if decided is None and not self.shared(item.entry_key):
            self.upcast[item.entry_key] = False  # one block's entry: its calls pass unchanged
            return proceed(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or not torch.is_autocast_enabled(tensors[0].device.type):
            return proceed(*args, **kwargs)  # only under autocast (a model cast to bf16 whole keeps its inputs)
        if decided:
            return proceed(*_upcast(args), **_upcast(kwargs))
        if not any(_low_precision(t) for t in tensors):
            self.upcast[item.entry_key] = _on_every_rank(False)
            return proceed(*args, **kwargs)
        output, equal = self._run_and_compare(item.region.module, args, kwargs, tensors)
        equal = self.upcast[item.entry_key] = _on_every_rank(equal)
        if equal:
            log.info("%s: lower-precision inputs upcast to float32 (the block promotes them)", item.region.name)
            self.on_upcast(item.region.name)
        return output

    @staticmethod
    def _run_and_compare(
        module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], tensors: List[torch.Tensor]
    ) -> Tuple[Any, bool]:
        """The call itself (eagerly), and whether the block's forward on upcast inputs gives equal outputs;
        ``tensors``: the call's tensors (their CUDA devices' random states are kept)."""
        devices = sorted({t.device.index for t in tensors if t.is_cuda})
        before = _random_state(devices)
        output = compat.call_uncompiled(module, *args, **kwargs)
        outputs = _floating(output)
        if not outputs or any(t.dtype != torch.float32 for t in outputs) or _has_hooks(module):
            return output, False  # a forward without its hooks (FSDP's all-gather, say) would not be the same call
        after = _random_state(devices)
        buffers = [(b, b.clone()) for b in module.buffers()]
        try:
            _set_random_state(before, devices)
            with torch.no_grad(), compat.outside_dispatch_modes():
                again = _floating(module.forward(*_upcast(args), **_upcast(kwargs)))
        except Exception as error:  # noqa: BLE001 - the check failing is a "no", never the step's failure
            log.info("%s: inputs not upcast, the check failed: %r", type(module).__name__, error)
            return output, False
        finally:
            _set_random_state(after, devices)
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        equal = len(again) == len(outputs) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b) for a, b in zip(outputs, again)
        )
        return output, equal


def _any_autocast() -> bool:
    """Cheap, before looking at a call's tensors: every call of a run without autocast asks."""
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def _on_every_rank(upcast: bool) -> bool:
    """Under torch.distributed, the ranks decide together (upcast where every rank's check agreed): a rank whose
    entry compiled a graph per dtype where the others compiled one would compile graphs they never do, and with
    compiler collectives the others would wait for it. Every rank makes each entry's decision at the same call."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return upcast
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    agreed = torch.tensor([int(upcast)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(m, hooks) for m in module.modules() for hooks in ("_forward_pre_hooks", "_forward_hooks"))


def _random_state(devices: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_random_state(state: Tuple[torch.Tensor, List[torch.Tensor]], devices: List[int]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, device_state in zip(devices, cuda):
        torch.cuda.set_rng_state(device_state, device)
