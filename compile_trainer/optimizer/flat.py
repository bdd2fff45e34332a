"""Flat buffers for the compiled step: every parameter, gradient and state tensor of one segment (a param group's
parameters of one device and dtype) is a view into one contiguous buffer per role.

The compiled update then reads a handful of flat tensors (few kernels, few guards, a short compile) while the
model and the optimizer keep their own objects: parameters stay the same ``nn.Parameter`` (their ``data`` is a
view), and ``optimizer.state[p]`` holds standard tensors (views), so ``state_dict`` is the optimizer's own.
Gradients arrive from backward as new tensors (Lightning and ``zero_grad`` set them to ``None``). An update
that reads each gradient where backward left it (the Triton kernel, ``flat_grads=False``) takes them as they
are. For the Inductor update (``flat_grads=True``), a post-accumulate-grad hook on each parameter copies its
gradient into a flat gradient buffer as soon as backward produces it (freeing the new tensor at once, so
gradients take no more memory than without the layout) and leaves ``p.grad`` a view of the buffer, so
accumulation over several backwards adds in place; gradients set by hand are gathered at the step with one
multi-tensor copy.

Each parameter's place in a flat buffer starts at a multiple of ``ALIGNMENT`` elements, so a kernel may load
any of them with wide (16-byte) accesses.

For clipping by norm the step takes every gradient's norm (one multi-tensor reduction per segment) from the
gradients as they are then, after whatever changed them since backward (accumulation, a GradScaler's unscaling,
DDP's averaging, hand edits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def _param_ids(optimizer: torch.optim.Optimizer) -> List[List[int]]:
    return [[id(p) for p in group["params"]] for group in optimizer.param_groups]


def _gather_into(segment: FlatSegment, index: int):
    view = segment.grad_views[index]

    def gather(param: Tensor) -> None:
        if param.grad is not view:  # else backward added into the view in place (accumulation)
            view.copy_(param.grad)
            param.grad = view

    return gather


def _differ(counts: List[Tensor]) -> bool:
    """Whether step counts differ, with one device sync (not one per parameter: ``auto``'s trial binds the state
    again after each eager candidate's step)."""
    stacked = torch.stack([count.to(counts[0].device, torch.float64) for count in counts])
    return bool((stacked != stacked[0]).any())


def _same_objects(lists: List[List[Tensor]], others: List[List[Tensor]]) -> bool:
    """The very same tensor objects (``==`` on tensors compares values)."""
    pairs = list(zip(lists, others))
    return len(lists) == len(others) and all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in pairs)


ALIGNMENT = 16  # elements: 64 bytes of float32, 32 of bfloat16


def aligned_offsets(tensors: Sequence[Tensor]) -> Tuple[List[int], int]:
    """Where each of ``tensors`` starts in a flat buffer (a multiple of ``ALIGNMENT``), and the buffer's size."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() // ALIGNMENT) * ALIGNMENT
    return offsets, end


def _views(flat: Tensor, tensors: Sequence[Tensor]) -> List[Tensor]:
    """Views of ``flat`` shaped like each of ``tensors``, at ``aligned_offsets``."""
    offsets, _ = aligned_offsets(tensors)
    return [flat[o : o + t.numel()].view(t.shape) for o, t in zip(offsets, tensors)]


def _flatten(tensors: Sequence[Tensor], like: Tensor) -> Tuple[Tensor, List[Tensor]]:
    """A new flat buffer (``like``'s device and dtype) holding ``tensors``, and its view shaped like each (the
    alignment padding is zeros)."""
    flat = torch.zeros(aligned_offsets(tensors)[1], device=like.device, dtype=like.dtype)
    views = _views(flat, tensors)
    torch._foreach_copy_(views, [t.detach() for t in tensors])
    return flat, views


@dataclass
class FlatSegment:
    """One param group's parameters of one device and dtype, and their flat buffers."""

    group: int
    params: List[Tensor]
    param: Tensor
    grad: Optional[Tensor]  # the flat gradient buffer, when the update reads one (else None)
    grad_views: List[Tensor]
    state: List[Tensor] = field(default_factory=list)  # per state key, then Adam's step vector
    state_views: List[List[Tensor]] = field(default_factory=list)  # what optimizer.state holds, per key
    grad_norms: Optional[Tensor] = None  # each parameter's gradient norm (float32), for clipping by norm

    def __post_init__(self) -> None:
        self.grad_norms = torch.zeros(len(self.params), device=self.param.device, dtype=torch.float32)

    def tensors(self) -> List[Tensor]:
        return [self.param, self.grad, *self.state]

    def grads(self) -> List[Tensor]:
        """The gradients as the update reads them: views of the flat buffer, or each parameter's own."""
        return self.grad_views if self.grad is not None else [param.grad for param in self.params]

    def compute_norms(self) -> None:
        """Every parameter's gradient norm from the gradients as they are now (one multi-tensor reduction)."""
        torch.stack(torch._foreach_norm(self.grads(), 2, dtype=torch.float32), out=self.grad_norms)


class FlatLayout:
    """The segments of one optimizer; parameters become views at construction, state when ``bind_state`` runs.

    ``flat_grads``: gradients are gathered into a flat buffer per segment (by backward hooks); else the update
    reads each parameter's own gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer, flat_grads: bool = True):
        self.optimizer = optimizer
        self.flat_grads = flat_grads
        self.segments: List[FlatSegment] = []
        self.frozen: List[Tensor] = []
        for index, group in enumerate(optimizer.param_groups):
            by_kind: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
            for param in group["params"]:
                if not param.requires_grad:
                    self.frozen.append(param)  # not laid out: should it get a gradient later, the step runs eagerly
                else:
                    by_kind.setdefault((param.device, param.dtype), []).append(param)
            for params in by_kind.values():
                flat, views = _flatten(params, params[0])
                for param, view in zip(params, views):
                    param.data = view
                grad = torch.zeros_like(flat) if flat_grads else None
                grad_views = _views(grad, params) if flat_grads else []
                self.segments.append(FlatSegment(index, params, flat, grad, grad_views))
        self.bound = False
        self.binds = 0  # how many times the state was (re)bound: an update caching anything about it compares
        self._param_ids = _param_ids(optimizer)
        self._hooks: List[torch.utils.hooks.RemovableHandle] = []
        self.install_hooks()

    @property
    def hooked(self) -> bool:
        """Whether backward gathers the gradients (else the step does)."""
        return bool(self._hooks)

    def install_hooks(self) -> None:
        if self.flat_grads and not self._hooks:
            self._hooks = [
                param.register_post_accumulate_grad_hook(_gather_into(segment, index))
                for segment in self.segments
                for index, param in enumerate(segment.params)
            ]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def bind_state(self, keys: Sequence[Tuple[str, ...]], with_step: bool) -> Optional[str]:
        """Move each parameter's state tensors (``keys`` per group) into flat buffers; the reason when it cannot:
        a parameter without state yet, or step counts that differ within a segment."""
        state = self.optimizer.state
        for segment in self.segments:
            names = keys[segment.group] + (("step",) if with_step else ())
            if any(name not in state[p] for p in segment.params for name in names):
                return "a parameter has no optimizer state yet"
            if with_step and _differ([state[p]["step"] for p in segment.params]):
                return f"param group {segment.group}: parameters have different step counts"
        for segment in self.segments:
            names = keys[segment.group] + (("step",) if with_step else ())
            current = [[state[p][name] for p in segment.params] for name in names]
            if _same_objects(current, segment.state_views):
                continue  # still the views (an eager step updates them in place): same buffers, same addresses
            segment.state, segment.state_views = [], []
            for name, tensors in zip(names, current):
                if name == "step":  # one vector, each parameter's count a 0-d view of its element
                    flat = torch.stack([t.to(segment.param.device, torch.float32) for t in tensors])
                    views = list(flat.unbind())
                else:
                    flat, views = _flatten(tensors, segment.param)
                segment.state.append(flat)
                segment.state_views.append(views)
                for param, view in zip(segment.params, views):
                    state[param][name] = view
        self.bound = True
        self.binds += 1
        return None

    def gather_grads(self) -> List[str]:
        """Copy gradients that are not views of the flat buffer into it (with ``flat_grads``); what keeps the
        update from running (parameters without a gradient, or with one but frozen when the layout was made)."""
        if self._param_ids != _param_ids(self.optimizer):
            return ["the param groups changed since the step was installed (add_param_group?)"]
        missing = [f"frozen at install {tuple(p.shape)} has one now" for p in self.frozen if p.grad is not None]
        sources, targets = [], []
        for segment in self.segments:
            for index, param in enumerate(segment.params):
                grad = param.grad
                if grad is None:
                    missing.append(f"group {segment.group} {tuple(param.shape)} has none")
                elif grad.is_sparse:
                    raise RuntimeError("compiled optimizer step: sparse gradients are not supported")
                elif self.flat_grads and grad is not segment.grad_views[index]:
                    sources.append(grad)
                    targets.append(segment.grad_views[index])
        if missing:
            return missing
        if sources:
            torch._foreach_copy_(targets, sources)
            for segment in self.segments:
                for param, view in zip(segment.params, segment.grad_views):
                    param.grad = view
        return []
