"""Throughput: step time, steps/s, samples/s, items/s, achieved FLOP/s and MFU, peak device memory.

A step is timed from its start to its end (in Lightning: ``on_train_batch_start`` to
``on_train_batch_end``, so forward, backward and optimizer step, without data loading or validation).
Steps during which something compiled ("compile steps") are reported separately and never enter the
steady-state figures. On CUDA each step is bracketed by two CUDA events on the current stream that
are read back lazily (``Event.query()``): timing adds no synchronization to a step. Only
``summary(wait=True)`` synchronizes, once, on the last step's event.
"""

from __future__ import annotations

import copy
import itertools
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

BatchCounter = Callable[[Any], int]


def default_samples(batch: Any) -> int:
    """The leading dimension of the batch's first tensor (Lightning's own rule for ``self.log``)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    return extract_batch_size(batch)


@dataclass
class _Totals:
    steps: int = 0
    seconds: float = 0.0
    samples: int = 0
    items: int = 0


class _HostClock:
    """Wall-clock step times, for the CPU (where work is synchronous)."""

    def __init__(self) -> None:
        self._started = 0.0
        self._done: List[Tuple[float, Any]] = []

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, tag: Any) -> None:
        self._done.append((time.perf_counter() - self._started, tag))

    def completed(self, wait: bool) -> List[Tuple[float, Any]]:
        done, self._done = self._done, []
        return done


class _CudaClock:
    """Step times on the GPU's timeline from CUDA events, read once they have completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._current: Optional[Tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self._pending: Deque[Tuple[Tuple[torch.cuda.Event, torch.cuda.Event], Any]] = deque()

    def start(self) -> None:
        if self._free:
            pair = self._free.pop()
        else:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record(torch.cuda.current_stream(self.device))
        self._current = pair

    def stop(self, tag: Any) -> None:
        pair, self._current = self._current, None
        pair[1].record(torch.cuda.current_stream(self.device))
        self._pending.append((pair, tag))

    def completed(self, wait: bool) -> List[Tuple[float, Any]]:
        done = []
        while self._pending:
            (start, end), tag = self._pending[0]
            if not end.query():
                if not wait:
                    break
                end.synchronize()
            done.append((start.elapsed_time(end) / 1000.0, tag))
            self._pending.popleft()
            self._free.append((start, end))
        return done


class ThroughputMeter:
    """Accumulates step times; ``interval()`` gives figures since its last call, ``summary()`` for the run.

    Args:
        device: where the steps run (CUDA: event timing; otherwise wall clock).
        samples_fn: batch -> number of samples (default: the leading dimension of its first tensor).
        items_fn: batch -> number of items (tokens for the recipes); or give ``items_per_sample``.
        flops_per_step: model FLOPs of one step (forward + backward), for TFLOP/s and MFU.
        peak_flops: the device's peak FLOP/s, for MFU.
    """

    def __init__(
        self,
        device: torch.device,
        samples_fn: Optional[BatchCounter] = None,
        items_fn: Optional[BatchCounter] = None,
        items_per_sample: Optional[int] = None,
        flops_per_step: Optional[float] = None,
        peak_flops: Optional[float] = None,
    ) -> None:
        self.device = torch.device(device)
        self.samples_fn = samples_fn or default_samples
        self.items_fn = items_fn
        self.items_per_sample = items_per_sample
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self._clock = _CudaClock(self.device) if self.device.type == "cuda" else _HostClock()
        self.steady = _Totals()
        self.compiling = _Totals()
        self.first_step_time_s: Optional[float] = None
        self._interval_steady = _Totals()
        self._interval_compiling = _Totals()

    def step_start(self) -> None:
        self._clock.start()

    def step_end(self, batch: Any, compiled: bool) -> None:
        """End the step begun by ``step_start``; ``compiled``: something compiled during it."""
        samples = int(self.samples_fn(batch))
        if self.items_fn is not None:
            items = int(self.items_fn(batch))
        elif self.items_per_sample is not None:
            items = samples * int(self.items_per_sample)
        else:
            items = 0
        self._clock.stop((compiled, samples, items))
        self._read(wait=False)

    def _read(self, wait: bool) -> None:
        for seconds, (compiled, samples, items) in self._clock.completed(wait):
            if self.first_step_time_s is None:
                self.first_step_time_s = seconds
            for totals in (
                (self.compiling, self._interval_compiling) if compiled else (self.steady, self._interval_steady)
            ):
                totals.steps += 1
                totals.seconds += seconds
                totals.samples += samples
                totals.items += items

    @property
    def counts_items(self) -> bool:
        return self.items_fn is not None or self.items_per_sample is not None

    def _rates(self, totals: _Totals) -> Dict[str, Optional[float]]:
        if totals.steps == 0 or totals.seconds <= 0:
            return dict.fromkeys(("step_time_s", "steps_per_s", "samples_per_s", "items_per_s", "tflops", "mfu"))
        achieved = self.flops_per_step * totals.steps / totals.seconds if self.flops_per_step else None
        return {
            "step_time_s": totals.seconds / totals.steps,
            "steps_per_s": totals.steps / totals.seconds,
            "samples_per_s": totals.samples / totals.seconds,
            "items_per_s": totals.items / totals.seconds if self.counts_items else None,
            "tflops": achieved / 1e12 if achieved is not None else None,
            "mfu": achieved / self.peak_flops if achieved is not None and self.peak_flops else None,
        }

    def peak_memory_bytes(self) -> Optional[int]:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    def interval(self) -> Dict[str, float]:
        """Steady-state figures over the steps completed since the last call (``None`` values left out)."""
        self._read(wait=False)
        figures: Dict[str, Optional[float]] = dict(self._rates(self._interval_steady))
        if self._interval_compiling.steps:
            figures["compile_step_time_s"] = self._interval_compiling.seconds / self._interval_compiling.steps
        figures["peak_memory_bytes"] = self.peak_memory_bytes()
        self._interval_steady, self._interval_compiling = _Totals(), _Totals()
        return {key: value for key, value in figures.items() if value is not None}

    def summary(self, wait: bool = True) -> Dict[str, Optional[float]]:
        """The run's throughput headline numbers (stable keys; ``None`` where unknown)."""
        self._read(wait=wait)
        steady = self._rates(self.steady)
        return {
            "steps": self.steady.steps + self.compiling.steps,
            "compile_steps": self.compiling.steps,
            "compile_steps_time_s": self.compiling.seconds,
            "first_step_time_s": self.first_step_time_s,
            "steady_steps": self.steady.steps,
            "steady_step_time_s": steady["step_time_s"],
            "steady_steps_per_s": steady["steps_per_s"],
            "steady_samples_per_s": steady["samples_per_s"],
            "steady_items_per_s": steady["items_per_s"],
            "flops_per_step": self.flops_per_step,
            "steady_tflops": steady["tflops"],
            "peak_tflops": self.peak_flops / 1e12 if self.peak_flops else None,
            "mfu": steady["mfu"],
            "peak_memory_bytes": self.peak_memory_bytes(),
        }


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device, made without copying any parameter or buffer data."""
    memo: Dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def to_meta(batch: Any) -> Any:
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor, lambda t: torch.empty_like(t, device="meta"))


def training_step_loss(module: nn.Module, batch: Any) -> Any:
    """A LightningModule's ``training_step`` loss (``None`` where it returns none, e.g. manual optimization)."""
    output = module.training_step(batch, 0)
    return output["loss"] if isinstance(output, Mapping) else output


def measure_step_flops(
    meta_module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] = training_step_loss
) -> int:
    """FLOPs of one forward + backward of ``loss_fn(meta_module, batch)``, counted on the meta device.

    ``meta_module`` comes from ``meta_copy`` (taken before any compilation); ``batch`` may live anywhere.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with warnings.catch_warnings(), torch.compiler.set_stance("force_eager"):
        warnings.simplefilter("ignore")  # e.g. self.log() without a Trainer
        with counter:
            loss = loss_fn(meta_module, to_meta(batch))
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    return int(counter.get_total_flops())


def precision_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a Lightning precision setting (``"bf16-mixed"`` -> ``torch.bfloat16``)."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32


def device_peak_flops(device: torch.device, dtype: torch.dtype, peak_tflops: Optional[float]) -> Optional[float]:
    """``peak_tflops`` if given, else Lightning's table for CUDA devices (which lacks some, e.g. H200)."""
    if peak_tflops:
        return float(peak_tflops) * 1e12
    if torch.device(device).type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flops = get_available_flops(torch.device(device), dtype)
    return float(flops) if flops else None
