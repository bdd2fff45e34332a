"""The update as one Triton kernel per segment that reads each gradient where backward left it (host side: the
block and address tables, the scalars, the launches; the kernels are in ``triton_kernels.py``).

The Inductor update (``inductor_update.py``) needs the gradients in a flat buffer, and backward leaves each one in
a tensor of its own: copying them costs 2 passes over the gradient bytes and a kernel per parameter, which
torch's fused AdamW never pays. This kernel takes a table of the gradients' addresses instead, as torch's fused
kernels do: each program updates one block of one parameter, reading that parameter's gradient in place and its
parameter and state from the segment's flat buffers (``flat.py``). AdamW then moves 7 passes over the parameter
bytes in one launch per segment, the floor for its arithmetic.

Scalars (bias corrections, ``1 - beta``...) are computed on the host in float64 from the param groups' Python
floats, as torch's single-tensor step computes them, and passed to the kernel as float32, as its kernels take
them; the step count is kept on the host too (read once when the state is bound), and the kernel writes it into
the optimizer's step tensors. A scheduler changing any value changes arguments, never the compiled kernel.

Clipping by norm takes every gradient's norm with torch's multi-tensor reduction (one read of the gradients, in
place) into the step's ``grad_norm``, which the kernel reads to compute the clip coefficient: no host sync, no
pass to scale the gradients. Clipping by value clamps inside the kernel.

With ``TRITON_INTERPRET=1`` the kernels run on the CPU through Triton's interpreter (the tests use it).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Set, Tuple

import torch
import triton
from torch import Tensor

from compile_trainer.optimizer.algorithms import ADAM, Clipping
from compile_trainer.optimizer.flat import FlatLayout, FlatSegment, aligned_offsets
from compile_trainer.optimizer.triton_kernels import adam_kernel, sgd_kernel

BLOCK = 2048  # elements per program
NUM_WARPS = 8


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _float32(value: float) -> float:
    """``value`` rounded to float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass
class _Blocks:
    """Which parameter each program of a segment's kernel updates, and where (static: the layout never moves)."""

    param: Tensor  # int32, per block: the parameter's index in the segment
    start: Tensor  # int64, per block: its first element in the flat buffers
    param_start: Tensor  # int64, per parameter
    param_end: Tensor  # int64, per parameter
    grad_table: Tensor  # int64, per parameter: its gradient's address, written when the addresses change
    addresses: Tuple[int, ...] = ()

    @classmethod
    def of(cls, segment: FlatSegment) -> _Blocks:
        offsets, _ = aligned_offsets(segment.params)
        starts, owners = [], []
        for index, (offset, param) in enumerate(zip(offsets, segment.params)):
            blocks = range(offset, offset + param.numel(), BLOCK)
            starts += blocks
            owners += [index] * len(blocks)
        ends = [offset + param.numel() for offset, param in zip(offsets, segment.params)]
        device = segment.param.device

        def on_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(
            on_device(owners, torch.int32),
            on_device(starts, torch.int64),
            on_device(offsets, torch.int64),
            on_device(ends, torch.int64),
            torch.zeros(len(segment.params), dtype=torch.int64, device=device),
        )

    def point_at(self, grads: List[Tensor]) -> bool:
        """Write the gradients' addresses into the table (only when they changed: the caching allocator usually
        hands backward the same blocks every step); whether all of them are 16-byte aligned."""
        addresses = tuple(grad.data_ptr() for grad in grads)
        if addresses != self.addresses:
            table = torch.tensor(addresses, dtype=torch.int64)
            if self.grad_table.is_cuda:
                table = table.pin_memory()  # an asynchronous copy: no wait for the queued backward
            self.grad_table.copy_(table, non_blocking=True)
            self.addresses = addresses
        return all(address % 16 == 0 for address in addresses)


class TritonUpdate:
    """The compiled update over ``layout``'s segments: one Triton kernel launch per segment (after one
    multi-tensor norm, with clipping by norm)."""

    name = "triton"

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm, layout: FlatLayout):
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.layout = layout
        self.blocks = [_Blocks.of(segment) for segment in layout.segments]
        self._counts: List[float] = []  # Adam's step count per segment, on the host
        self._counts_of_bind = -1
        self.launches = 0
        self.specializations: Set[Tuple] = set()  # (kernel, compile-time constants): what Triton compiled

    def describe(self) -> str:
        return f"Triton kernel (block {BLOCK}, {NUM_WARPS} warps{', interpreted' if interpreted() else ''})"

    def note_eager_step(self) -> None:
        """The optimizer's own step advanced every step count by one (auto's trial), as the host copy does now."""
        self._counts = [count + 1 for count in self._counts]

    def run(self, clip: Clipping, grad_norm: Tensor) -> None:
        segments = self.layout.segments
        grads = [[grad if grad.is_contiguous() else grad.contiguous() for grad in s.grads()] for s in segments]
        if clip[0] is not None:
            norms = torch._foreach_norm([g for group in grads for g in group], 2, dtype=torch.float32)
            torch.linalg.vector_norm(torch.stack(norms), out=grad_norm)
        if self.algorithm is ADAM and self._counts_of_bind != self.layout.binds:
            self._counts = [float(segment.state[-1][0]) for segment in segments]  # one sync per bind
            self._counts_of_bind = self.layout.binds
        for index, (segment, blocks, segment_grads) in enumerate(zip(segments, self.blocks, grads)):
            aligned = blocks.point_at(segment_grads)
            group = self.optimizer.param_groups[segment.group]
            flags = self.algorithm.flags(self.optimizer, group)
            if self.algorithm is ADAM:
                self._counts[index] += 1
                self._adam(segment, blocks, group, flags, self._counts[index], clip, grad_norm, aligned)
            else:
                self._sgd(segment, blocks, group, flags, clip, grad_norm, aligned)
            self.launches += 1

    def _launch(
        self, kernel, blocks: _Blocks, buffers: List[Tensor], scalars: List[Any], clip: Clipping, grad_norm, **constants
    ):
        """One launch over the segment's blocks: ``buffers`` (flat parameter and state), the block tables, the total
        gradient norm, ``scalars``, the clip limit; ``constants`` and the clipping are compile-time constants."""
        clip_norm, clip_value = clip
        constants |= {"CLIP_NORM": clip_norm is not None, "CLIP_VALUE": clip_value is not None, "BLOCK": BLOCK}
        self.specializations.add((kernel.fn.__name__, tuple(sorted(constants.items()))))
        options: Dict[str, Any] = {"num_warps": NUM_WARPS}
        if not interpreted():
            options["enable_fp_fusion"] = False  # a fused multiply-add only where torch's kernels have one
        tables = [blocks.grad_table, blocks.param, blocks.start, blocks.param_start, blocks.param_end]
        kernel[(blocks.param.numel(),)](
            *buffers, *tables, grad_norm, *scalars, clip_norm or clip_value or 0.0, **constants, **options
        )

    def _adam(self, segment: FlatSegment, blocks: _Blocks, group, flags, step: float, clip, grad_norm, aligned: bool):
        """Scalars as torch's single-tensor step computes them from the group's Python floats."""
        amsgrad, maximize, decoupled = flags
        lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(beta) for beta in group["betas"])
        # a division by a host scalar is a multiplication by its float32 reciprocal in torch's CUDA kernel
        inv_bias_correction2_sqrt = 1.0 / _float32(math.sqrt(1 - beta2**step))
        exp_avg, exp_avg_sq = segment.state[0], segment.state[1]
        buffers = [segment.param, exp_avg, exp_avg_sq, segment.state[2] if amsgrad else exp_avg_sq, segment.state[-1]]
        scalars = [len(segment.params), step, -lr / (1 - beta1**step), inv_bias_correction2_sqrt, eps]
        scalars += [1 - lr * weight_decay, weight_decay, 1 - beta1, beta2, 1 - beta2]
        self._launch(
            adam_kernel,
            blocks,
            buffers,
            scalars,
            clip,
            grad_norm,
            ALIGNED=aligned,
            AMSGRAD=amsgrad,
            MAXIMIZE=maximize,
            DECOUPLED=decoupled,
            STEPS_BLOCK=triton.next_power_of_2(len(segment.params)),
        )

    def _sgd(self, segment: FlatSegment, blocks: _Blocks, group, flags, clip, grad_norm, aligned: bool):
        has_momentum, nesterov, maximize = flags
        buffers = [segment.param, segment.state[0] if has_momentum else segment.param]
        scalars = [-float(group["lr"]), float(group["momentum"]), 1 - float(group["dampening"])]
        scalars.append(float(group["weight_decay"]))
        self._launch(
            sgd_kernel,
            blocks,
            buffers,
            scalars,
            clip,
            grad_norm,
            ALIGNED=aligned,
            HAS_MOMENTUM=has_momentum,
            NESTEROV=nesterov,
            MAXIMIZE=maximize,
        )
