"""Throughput: step time, steps/s, samples/s, items/s, achieved FLOP/s and MFU, peak device memory.

A step is timed from its start to its end (in Lightning: ``on_train_batch_start`` to
``on_train_batch_end``, so forward, backward and optimizer step, without data loading or validation).
Steps during which something compiled ("compile steps") are reported separately and never enter the
steady-state figures. On CUDA each step is bracketed by two CUDA events on the current stream that
are read back lazily (``Event.query()``): timing adds no synchronization to a step. Only
``summary(wait=True)`` synchronizes, once, on the last step's event.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from compile_trainer import compat

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


@contextlib.contextmanager
def preserved_training_state(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run steps that leave no trace: RNG streams, gradients and buffers are restored afterwards."""
    grads = [(p, p.grad) for p in module.parameters()]
    for parameter, _ in grads:
        parameter.grad = None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [] if device.type == "cpu" else [device.index if device.index is not None else 0]
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield
    finally:
        for parameter, grad in grads:
            parameter.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


@contextlib.contextmanager
def compiled_calls_set_aside(module: nn.Module) -> Iterator[None]:
    """Every submodule runs its own eager ``forward``: the compiled calls installed on them (a policy's regions,
    with their interceptors; ``module.compile()``) are taken off, and put back afterwards."""
    calls = [(m, call) for m in module.modules() if (call := compat.compiled_call(m)) is not None]
    for submodule, _ in calls:
        compat.install_compiled_call(submodule, None)
    try:
        yield
    finally:
        for submodule, call in calls:
            compat.install_compiled_call(submodule, call)


def training_step_loss(module: nn.Module, batch: Any) -> Any:
    """A LightningModule's ``training_step`` loss (``None`` where it returns none), called as Lightning calls it."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    step = module.training_step
    if is_param_in_hook_signature(step, "dataloader_iter", explicit=True):
        raise ValueError("training_step takes a dataloader_iter: it cannot run once more on a given batch")
    output = step(batch, 0) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else step(batch)
    return output.get("loss") if isinstance(output, Mapping) else output


def _device_of(module: nn.Module) -> torch.device:
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def measure_step_flops(
    module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] = training_step_loss
) -> int:
    """FLOPs of one forward + backward of ``loss_fn(module, batch)``, counted on the real module and batch.

    ``torch.utils.flop_counter.FlopCounterMode`` counts the ATen ops of one eager run: compiled calls set aside,
    any other ``torch.compile`` under ``set_stance("force_eager")``. Real tensors, so models that read values
    (``.item()``, data-dependent shapes: most Hugging Face and timm models) are counted too. The run leaves no
    trace (``preserved_training_state``: gradients, buffers such as BatchNorm's running statistics, and the
    RNG streams are restored), but costs one eager forward and backward: its time, and the memory of an eager
    step. Raises ``ValueError`` when ``loss_fn`` returns no tensor to differentiate.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with (
        preserved_training_state(module, _device_of(module)),
        compiled_calls_set_aside(module),
        torch.compiler.set_stance("force_eager"),
        torch.enable_grad(),
        counter,
    ):
        loss = loss_fn(module, batch)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ValueError(f"the step returned no loss to differentiate (got {type(loss).__name__})")
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


# Dense peak TFLOP/s (no 2:4 sparsity: datasheets print the sparse figure, twice these) by matmul dtype.
# H100 SXM5 / PCIe: NVIDIA H100 Tensor Core GPU Architecture whitepaper (dense columns), bf16/fp16 989.4 / 756,
# tf32 494.7 / 378, fp32 66.9 / 51.2. H100 NVL (one 94 GB card) and H200 NVL: H100 and H200 datasheets,
# bf16/fp16 1,671 and tf32 835 sparse, fp32 60 TFLOP/s. H200 (SXM, also GH200): the H200 datasheet, same
# figures as the H100 SXM (1,979 bf16 and 989 tf32 sparse, fp32 67). A100 (SXM and PCIe, 40 and 80 GB): the
# A100 datasheet, bf16/fp16 312, tf32 156, fp32 19.5. Looked up in this order, by substring of the device name.
# Lightning's table has H100 SXM, PCIe and A100 with these figures, but no match for "NVIDIA H200" and,
# for "NVIDIA H100 NVL", the figure of the two-card NVL pair (1,978.8 bf16): these rows come first.
_PEAK_TFLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    ("h200 nvl", {"16-bit": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h200", {"16-bit": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("h100 nvl", {"16-bit": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h100 pcie", {"16-bit": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("h100", {"16-bit": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("a100", {"16-bit": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


def table_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Peak FLOP/s of a known GPU (H100, H200, A100) from its name (``torch.cuda.get_device_name``) and the
    matmul dtype; ``tf32``: float32 matmuls run on TF32 tensor cores. ``None`` for any other device or dtype,
    and for a MIG slice (a fraction of the GPU)."""
    name = device_name.lower()
    column = {torch.bfloat16: "16-bit", torch.float16: "16-bit"}.get(dtype)
    if dtype is torch.float32:
        column = "tf32" if tf32 else "fp32"
    if column is None or "mig" in name.split():
        return None
    for key, peaks in _PEAK_TFLOPS:
        if key in name:
            return float(round(peaks[column] * 1e12))
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype, peak_tflops: Optional[float]) -> Optional[float]:
    """The device's peak FLOP/s for MFU: ``peak_tflops`` if given, else ``table_peak_flops`` (H100, H200,
    A100), else Lightning's table for other CUDA devices; ``None`` where unknown (and on the CPU)."""
    if peak_tflops:
        return float(peak_tflops) * 1e12
    device = torch.device(device)
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"  # as Lightning decides it
    known = table_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=tf32)
    if known is not None:
        return known
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, dtype)
    return float(flops) if flops else None
