"""The update as one ``torch.compile``d function over the flat buffers (``algorithms.update_segments``).

It reads the gradients from each segment's flat gradient buffer (``FlatLayout(flat_grads=True)``: backward's
hooks copy them in), and the hyperparameters of every group from one float64 tensor written each step from the
param groups' Python floats (one host-to-device copy, only when a value changed), so a scheduler never
recompiles. It runs on any device and backend, and under ``mode="reduce-overhead"`` (CUDA graphs).
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from compile_trainer import compat
from compile_trainer.compat import renamed_function
from compile_trainer.compiling.regions import ENTRY_PREFIX
from compile_trainer.optimizer.algorithms import Clipping, update_segments
from compile_trainer.optimizer.flat import FlatLayout


def _entry_function(optimizer: torch.optim.Optimizer) -> types.FunctionType:
    """``update_segments`` under its own code object, named like the regions' entries
    (``compiled_region__optimizer_step_AdamW``): its own Dynamo cache, and the compile telemetry attributes
    its compiles and recompiles to an ``optimizer_step_AdamW`` row."""
    return renamed_function(update_segments, f"{ENTRY_PREFIX}optimizer_step_{type(optimizer).__name__}")


class InductorUpdate:
    """The compiled update over ``layout``'s segments (compiled at its first call)."""

    name = "inductor"

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm, layout: FlatLayout, compile_kwargs: Dict[str, Any]):
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.layout = layout
        self.compile_kwargs = compile_kwargs
        entry = _entry_function(optimizer)
        self.entry_name = entry.__name__  # the code name Dynamo's compilation metrics report
        self._compiled = torch.compile(entry, **compile_kwargs)
        device = layout.segments[0].param.device if layout.segments else torch.device("cpu")
        # float64 keeps bias corrections as exact as torch's Python-float path; MPS has no float64.
        self._hyper_dtype = torch.float32 if device.type == "mps" else torch.float64
        self.hyper = torch.zeros(0, device=device, dtype=self._hyper_dtype)
        self._hyper_values: Optional[List[List[float]]] = None
        self._static_state_of_bind = -1
        for segment in layout.segments:
            compat.mark_static_address(segment.param)  # CUDA graphs need not copy them
            compat.mark_static_address(segment.grad)
            compat.mark_static_address(segment.grad_norms)

    def describe(self) -> str:
        kwargs = self.compile_kwargs
        return f"torch.compile backend={kwargs['backend']} mode={kwargs['mode'] or 'default'}"

    def note_eager_step(self) -> None:
        """The optimizer's own step ran on the bound state (the update reads the step counts on the device)."""

    def run(self, clip: Clipping, grad_norm: torch.Tensor) -> None:
        if self._static_state_of_bind != self.layout.binds:
            for segment in self.layout.segments:
                for tensor in segment.state:
                    compat.mark_static_address(tensor)  # CUDA graphs need not copy them
            self._static_state_of_bind = self.layout.binds
        flags = self._write_hyper()
        segments = self.layout.segments
        clip_norm = clip[0] is not None
        if clip_norm:
            for segment in segments:
                segment.compute_norms()
        with torch.no_grad():
            self._compiled(
                [segment.tensors() for segment in segments],
                self.hyper,
                tuple(segment.group for segment in segments),
                flags,
                clip,
                grad_norm if clip_norm else None,
                [segment.grad_norms for segment in segments] if clip_norm else None,
                self.algorithm.update_segment,
            )

    def _write_hyper(self) -> Tuple[Tuple[bool, ...], ...]:
        groups = self.optimizer.param_groups
        values = [self.algorithm.hyper(group) for group in groups]
        if values != self._hyper_values:
            if self.hyper.shape[0] != len(values):
                self.hyper = torch.zeros(len(values), len(values[0]), device=self.hyper.device, dtype=self._hyper_dtype)
                compat.mark_static_address(self.hyper)
            self.hyper.copy_(torch.tensor(values, dtype=self._hyper_dtype), non_blocking=True)
            self._hyper_values = values
        return tuple(self.algorithm.flags(self.optimizer, group) for group in groups)
