"""Throughput: step time, steps/s, samples/s, images/s, tokens/s, items/s, achieved FLOP/s and MFU, peak device
memory, and the speedup of compiled steps over eager ones.

A step is timed from its start to its end (in Lightning: ``on_train_batch_start`` to
``on_train_batch_end``, so forward, backward and optimizer step, without data loading or validation).
Steps during which something compiled ("compile steps", CUDA-graph recordings included) and the step whose FLOPs
were counted ("warm-up steps") are reported separately and never enter the steady-state figures; so are the
eager reference steps, run with the compiled regions' original code (``compiling.eager_reference``), whose median
(the first left out: it pays one-off costs) the steady median is compared with. On CUDA each step
is bracketed by two CUDA events on the current stream that are read back lazily (``Event.query()``): timing adds no
synchronization to a step. Only ``summary(wait=True)`` synchronizes, once, on the last step's event.

What a batch holds is counted by ``batch_counts`` (samples, images, tokens) unless functions are given.
"""

from __future__ import annotations

import statistics
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from compile_trainer.telemetry.batch_counts import Count, default_samples, is_image_batch, token_counts
from compile_trainer.telemetry.step_clocks import CudaClock, HostClock

BatchCounter = Callable[[Any], int]
COMPILE, WARMUP, STEADY, EAGER = "compile", "warm-up", "steady", "eager"  # kinds of steps
STEADY_WINDOW = 10_000  # steady steps kept for the median step time
RATES = ("step_time_s", "steps_per_s", "samples_per_s", "images_per_s", "tokens_per_s", "padded_tokens_per_s",
         "items_per_s", "tflops", "mfu")  # fmt: skip


def _read(count: Optional[Count]) -> Optional[int]:
    return int(count) if count is not None else None


@dataclass
class _Totals:
    steps: int = 0
    seconds: float = 0.0
    samples: int = 0
    images: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    items: int = 0

    def add(self, seconds: float, step: _Step) -> None:
        self.steps += 1
        self.seconds += seconds
        self.samples += step.samples
        self.images += step.images
        self.tokens += _read(step.tokens) or 0
        self.padded_tokens += step.padded_tokens or 0
        self.items += _read(step.items) or 0


@dataclass
class _Step:
    """What a step carries to its reading: its kind and the batch's counts."""

    kind: str = STEADY
    recorded_cuda_graphs: bool = False
    warmed_up_cuda_graphs: bool = False
    eager_reference: bool = False
    samples: int = 0
    images: int = 0
    tokens: Optional[Count] = None
    padded_tokens: Optional[int] = None
    items: Optional[Count] = None


class ThroughputMeter:
    """Accumulates step times; ``interval()`` gives figures since its last call, ``summary()`` for the run.

    Args:
        device: where the steps run (CUDA: event timing; otherwise wall clock).
        samples_fn: batch -> number of samples (default: the leading dimension of its first tensor).
        items_fn: batch -> number of items; or give ``items_per_sample``; default: the tokens, else the samples.
        items_per_sample: items per sample, in a unit of your own.
        flops_per_step: model FLOPs of one step (forward + backward), for TFLOP/s and MFU.
        peak_flops: the device's peak FLOP/s, for MFU.
        tokens_fn: batch -> number of (real) tokens (default: ``token_counts``, which also gives padded tokens).
    """

    def __init__(
        self,
        device: torch.device,
        samples_fn: Optional[BatchCounter] = None,
        items_fn: Optional[BatchCounter] = None,
        items_per_sample: Optional[int] = None,
        flops_per_step: Optional[float] = None,
        peak_flops: Optional[float] = None,
        tokens_fn: Optional[BatchCounter] = None,
        items_name: str = "items",
    ) -> None:
        self.device = torch.device(device)
        self.samples_fn = samples_fn or default_samples
        self.tokens_fn = tokens_fn
        self.items_fn = items_fn
        self.items_per_sample = items_per_sample
        self.items_name = items_name
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self._clock = CudaClock(self.device) if self.device.type == "cuda" else HostClock()
        self.totals: Dict[str, _Totals] = {kind: _Totals() for kind in (COMPILE, WARMUP, STEADY, EAGER)}
        self.cudagraph_recording_steps = 0
        self.cudagraph_warmup_steps = 0
        self.first_step_time_s: Optional[float] = None  # the first step after the eager reference steps
        # The last STEADY_WINDOW steady steps' times, for the median: a mean over a run carries its outliers
        # (an allocator growth, a collective's first call, a GC pause) into every steady figure.
        self._steady_times: Deque[float] = deque(maxlen=STEADY_WINDOW)
        self.eager_reference_steps = 0  # run, whatever their kind
        self.eager_peak_memory_bytes: Optional[int] = None  # the device's peak during them (CUDA)
        self._eager_times: List[float] = []  # eager reference steps after the first that compiled nothing
        self.counts_tokens = tokens_fn is not None
        self.counts_padded_tokens = False
        self.counts_images = False
        self._interval: Dict[str, _Totals] = {kind: _Totals() for kind in self.totals}
        self._step: Optional[_Step] = None

    @property
    def steady(self) -> _Totals:
        return self.totals[STEADY]

    @property
    def compiling(self) -> _Totals:
        return self.totals[COMPILE]

    @property
    def items_unit(self) -> str:
        """What items/s counts: the unit of your own (``items_name``), else ``tokens``, ``images`` or ``samples``."""
        if self.items_fn is not None or self.items_per_sample is not None:
            return self.items_name
        return "tokens" if self.counts_tokens else "images" if self.counts_images else "samples"

    def step_start(self, batch: Any) -> None:
        """Start a step on ``batch`` (its counts are taken now, before the step's clock starts)."""
        step = _Step(samples=int(self.samples_fn(batch)))
        if is_image_batch(batch):
            step.images, self.counts_images = step.samples, True
        if self.tokens_fn is not None:
            step.tokens = int(self.tokens_fn(batch))
        elif (counted := token_counts(batch)) is not None:
            step.tokens, step.padded_tokens = counted
            self.counts_tokens = self.counts_padded_tokens = True
        if self.items_fn is not None:
            step.items = int(self.items_fn(batch))
        elif self.items_per_sample is not None:
            step.items = step.samples * int(self.items_per_sample)
        else:
            step.items = step.tokens if step.tokens is not None else step.samples
        self._step = step
        self._clock.start()

    def step_end(
        self,
        kind: str = STEADY,
        recorded_cuda_graphs: bool = False,
        warmed_up_cuda_graphs: bool = False,
        eager_reference: bool = False,
    ) -> None:
        """End the step begun by ``step_start``: ``kind`` is ``COMPILE`` (something compiled during it, or CUDA
        graphs were recorded: ``recorded_cuda_graphs``), ``WARMUP`` (kept out of steady state for another reason,
        such as CUDA graphs run unrecorded before their recording: ``warmed_up_cuda_graphs``), ``EAGER`` (an eager
        reference step that compiled nothing) or ``STEADY``. ``eager_reference``: the step ran the compiled regions'
        original code, to compare compiled steps with (a reference step that compiled something is ``COMPILE``)."""
        step, self._step = self._step, None
        step.kind, step.eager_reference = kind, eager_reference
        step.recorded_cuda_graphs, step.warmed_up_cuda_graphs = recorded_cuda_graphs, warmed_up_cuda_graphs
        self._clock.stop(step)
        self._read(wait=False)
        if eager_reference and self.device.type == "cuda":  # the peak after them is the compiled steps'
            self.eager_peak_memory_bytes = max(self.eager_peak_memory_bytes or 0, self.peak_memory_bytes())
            torch.cuda.reset_peak_memory_stats(self.device)

    def _read(self, wait: bool) -> None:
        for seconds, step in self._clock.completed(wait):
            if step.eager_reference:
                self.eager_reference_steps += 1
                if step.kind == EAGER and self.eager_reference_steps > 1:  # the first pays one-off costs
                    self._eager_times.append(seconds)
            elif self.first_step_time_s is None:
                self.first_step_time_s = seconds
            self.cudagraph_recording_steps += step.recorded_cuda_graphs
            self.cudagraph_warmup_steps += step.warmed_up_cuda_graphs
            for totals in (self.totals[step.kind], self._interval[step.kind]):
                totals.add(seconds, step)
            if step.kind == STEADY:
                self._steady_times.append(seconds)

    def _rates(self, totals: _Totals) -> Dict[str, Optional[float]]:
        if totals.steps == 0 or totals.seconds <= 0:
            return dict.fromkeys(RATES)
        achieved = self.flops_per_step * totals.steps / totals.seconds if self.flops_per_step else None
        return {
            "step_time_s": totals.seconds / totals.steps,
            "steps_per_s": totals.steps / totals.seconds,
            "samples_per_s": totals.samples / totals.seconds,
            "images_per_s": totals.images / totals.seconds if self.counts_images else None,
            "tokens_per_s": totals.tokens / totals.seconds if self.counts_tokens else None,
            "padded_tokens_per_s": totals.padded_tokens / totals.seconds if self.counts_padded_tokens else None,
            "items_per_s": totals.items / totals.seconds,
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
        figures: Dict[str, Optional[float]] = dict(self._rates(self._interval[STEADY]))
        for kind, key in ((COMPILE, "compile_step_time_s"), (EAGER, "eager_step_time_s")):
            if self._interval[kind].steps:
                figures[key] = self._interval[kind].seconds / self._interval[kind].steps
        figures["peak_memory_bytes"] = self.peak_memory_bytes()
        self._interval = {kind: _Totals() for kind in self.totals}
        return {key: value for key, value in figures.items() if value is not None}

    def summary(self, wait: bool = True) -> Dict[str, Any]:
        """The run's throughput headline numbers (stable keys; ``None`` where unknown)."""
        self._read(wait=wait)
        steady = self._rates(self.steady)
        median = statistics.median(self._steady_times) if self._steady_times else None
        return {
            **self._step_counts(),
            "steady_step_time_s": steady["step_time_s"],
            "steady_step_time_median_s": median,
            "steady_steps_per_s": steady["steps_per_s"],
            "steady_samples_per_s": steady["samples_per_s"],
            "steady_images_per_s": steady["images_per_s"],
            "steady_tokens_per_s": steady["tokens_per_s"],
            "steady_padded_tokens_per_s": steady["padded_tokens_per_s"],
            "steady_items_per_s": steady["items_per_s"],
            "items_unit": self.items_unit,
            "flops_per_step": self.flops_per_step,
            "steady_tflops": steady["tflops"],
            "peak_tflops": self.peak_flops / 1e12 if self.peak_flops else None,
            "mfu": steady["mfu"],
            "peak_memory_bytes": self.peak_memory_bytes(),
            "eager_peak_memory_bytes": self.eager_peak_memory_bytes,
            **self._against_eager(median),
        }

    def _step_counts(self) -> Dict[str, Any]:
        return {
            "steps": sum(totals.steps for totals in self.totals.values()),
            "compile_steps": self.compiling.steps,
            "cudagraph_recording_steps": self.cudagraph_recording_steps,
            "cudagraph_warmup_steps": self.cudagraph_warmup_steps,
            "warmup_steps": self.totals[WARMUP].steps,
            "eager_steps": self.totals[EAGER].steps,
            "compile_steps_time_s": self.compiling.seconds,
            "warmup_steps_time_s": self.totals[WARMUP].seconds,
            "eager_steps_time_s": self.totals[EAGER].seconds,
            "first_step_time_s": self.first_step_time_s,
            "steady_steps": self.steady.steps,
        }

    def _against_eager(self, steady_median: Optional[float]) -> Dict[str, Any]:
        """The eager reference steps' median and the steady median's speedup over it (``None`` without either)."""
        eager = statistics.median(self._eager_times) if self._eager_times else None
        return {
            "eager_step_time_median_s": eager,
            "eager_steps_in_median": len(self._eager_times),
            "speedup_vs_eager": eager / steady_median if eager is not None and steady_median else None,
        }


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
