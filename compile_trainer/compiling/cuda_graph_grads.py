"""Gradients that outlive a CUDA-graph step: gradient accumulation and manual optimization under CUDA graphs.

With CUDA graphs (``mode: reduce-overhead``) a compiled region's backward writes the parameters' gradients
into the CUDA graphs' memory pool, and autograd installs that very memory as ``param.grad`` when it is the
first gradient. The next step's replays reuse the pool: a ``.grad`` still held then (a second micro-batch
accumulating into it) is overwritten. PyTorch raises "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run", or, on some versions, sums wrong values (pytorch/pytorch#169545).

``copy_cuda_graph_gradients`` hooks each parameter of the CUDA-graph regions so that the incoming gradient is
copied before autograd accumulates it: ``.grad`` is then ordinary memory. It costs one copy of those gradients
per backward, so it is for loops whose gradients outlive a step; a loop that steps the optimizer and drops
the gradients (``zero_grad(set_to_none=True)``) after every backward does not need it.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compile_trainer.compiling.arguments import kwargs_use_cuda_graphs
from compile_trainer.compiling.regions import AppliedPolicy


class GradientCopies:
    """The hooks installed by ``copy_cuda_graph_gradients``; ``remove()`` takes them off."""

    def __init__(self, handles: List[RemovableHandle], parameters: int):
        self.handles = handles
        self.parameters = parameters

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def describe(self) -> str:
        return (
            f"gradients of {self.parameters} parameters in CUDA-graph regions are copied out of the CUDA graph "
            "pool before they accumulate (they outlive a step: gradient accumulation or manual optimization)"
        )


def _copy(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


def copy_cuda_graph_gradients(applied: AppliedPolicy) -> GradientCopies:
    """Hook the parameters of every region compiled with CUDA graphs (each parameter once, shared ones too)."""
    parameters: Dict[int, nn.Parameter] = {}
    for item in applied.compiled:
        if kwargs_use_cuda_graphs(item.compile_kwargs):
            parameters |= {id(p): p for p in item.region.module.parameters() if p.requires_grad}
    handles = [parameter.register_hook(_copy) for parameter in parameters.values()]
    return GradientCopies(handles, len(parameters))
