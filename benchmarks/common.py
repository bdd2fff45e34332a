"""Shared pieces of the benchmarks: environment metadata, CUDA timing, and the result-file format.

Every benchmark writes one JSON file: ``{"benchmark", "title", "meta", "columns", "rows", "notes"}``;
``benchmarks/make_report.py`` renders all of them into ``docs/BENCHMARKS.md``. Importable without
hydra, omegaconf or wandb (the GPU image has none of them).
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from compile_trainer.tables import text_table


def is_recompile(metric: Any) -> bool:
    """A Dynamo compilation-metrics entry whose compile id "frame/attempt" has attempt > 0: a recompile."""
    match = re.search(r"(\d+)/(\d+)", str(metric.compile_id))
    return bool(match) and int(match.group(2)) > 0


def frame_compile_seconds(metric: Any) -> float:
    """A frame's compile time from a compilation-metrics entry; the field differs across torch versions
    (``entire_frame_compile_time_s``; ``duration_us`` where that is missing)."""
    seconds = getattr(metric, "entire_frame_compile_time_s", None)
    return seconds if seconds is not None else (getattr(metric, "duration_us", None) or 0) / 1e6


def split_variant(variant: str) -> Tuple[str, Dict[str, str]]:
    """``name@key=value@...``: a benchmark variant's name and its overrides (an experiment on a bundled policy)."""
    name, *pairs = variant.split("@")
    return name, {key: value for key, _, value in (pair.partition("=") for pair in pairs)}


def with_rule_changes(policy: Any, **changes: str) -> Any:
    """``policy`` with every rule's fields in ``changes`` replaced (``rest="outer"``, ``action="full"``): a
    benchmark's experiment on what the rest of a model costs, or on one graph in place of regions."""
    from compile_trainer.schema import to_policy

    return to_policy(policy, rules=[dict(vars(rule), **changes) for rule in policy.rules])


# Dense bf16 tensor-core peak (FLOP/s) by device name; Lightning does not know the H200 (same chip as H100 SXM).
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def environment() -> Dict[str, Any]:
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor()})",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return meta


def peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Per-step times from CUDA events (read once, at the end), or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pairs: List[Any] = []

    def start(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append((started, event))
        else:
            self.pairs.append((started, time.perf_counter()))

    def seconds(self) -> List[float]:
        synchronize(self.device)
        if self.device.type == "cuda":
            return [start.elapsed_time(end) / 1e3 for start, end in self.pairs]
        return [end - start for start, end in self.pairs]

    def median(self) -> float:
        return statistics.median(self.seconds())


class HostTimer:
    """Host time to issue one training step, apart from the device: before each step the device is held by a
    sleep kernel longer than the step's host work, so the host never waits for it and the wall time from one
    step's start to the next is what the host alone needs (on the CPU, that is the step). A host time near the
    device's step time means the loop is host-bound: any extra Python a step slows training down."""

    HOLD_S = 0.2

    def __init__(self, device: torch.device):
        self.device = device
        self.times: List[float] = []
        self._started: Optional[float] = None
        self._cycles = self._sleep_cycles(self.HOLD_S) if device.type == "cuda" else 0

    @staticmethod
    def _sleep_cycles(seconds: float) -> int:
        probe = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        return int(probe * seconds * 1e3 / start.elapsed_time(end))

    def step_start(self) -> None:
        """Call where each step starts: closes the previous step's interval and holds the device for the next."""
        now = time.perf_counter()
        if self._started is not None:
            self.times.append(now - self._started)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda._sleep(self._cycles)
        self._started = time.perf_counter()

    def median_ms(self) -> Optional[float]:
        return statistics.median(self.times) * 1e3 if self.times else None


def quiet_trainer(device: torch.device, **trainer_args: Any) -> Any:
    """A Lightning Trainer on one ``device`` without logger, checkpoints, progress bar, summary or validation."""
    import lightning.pytorch as pl

    defaults = dict(
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    return pl.Trainer(**(defaults | trainer_args))


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of ``fn`` with the device synchronized on both sides."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def write_result(
    path: Path, benchmark: str, title: str, columns: List[str], rows: List[Dict[str, Any]], notes: List[str]
) -> None:
    result = {
        "benchmark": benchmark,
        "title": title,
        "meta": environment(),
        "columns": columns,
        "rows": rows,
        "notes": notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def format_table(columns: List[str], rows: List[Dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return "-" if value is None else str(value)

    return "\n".join(text_table(columns, [[cell(row.get(c)) for c in columns] for row in rows]))
