"""A run's result file (``result.json`` in its run directory): what ``compile-trainer report`` reads.

Plain JSON with stable keys, written by ``train.py`` when a run ends, whether it finished or failed:

- ``status`` (``ok`` / ``failed``), ``error`` (``type``, ``message``, ``traceback``; ``None`` when ok);
- ``policy`` (the policy's name), ``policy_settings`` (every field of the policy), ``overrides`` (the
  Hydra overrides that define the run), ``sweep`` (``name``, ``dir``, ``job``);
- ``summary``: the telemetry headline numbers (``CompileCallback.summary()``, keys in docs/telemetry.md); on
  several ranks also ``ranks`` (each rank's first step, median step, recompiles, graphs, peak memory) and ``link``
  (the link probed at fit start, the step's communication on it, the faster settings);
- ``world_size``, ``strategy`` (``single``, ``ddp``, ``fsdp2``); on several ranks rank 0 writes the file (another
  rank that fails writes ``result.rank<N>.json``);
- ``final_train_loss``, ``final_val_loss``;
- what must be equal across a sweep: ``seed``, ``max_steps``, ``steps`` (steps trained), ``recipe``,
  ``data`` and ``model`` (the recipe's settings), ``precision``, ``fresh_cache``;
- ``environment``: the device and the versions of Python, torch, Lightning, Triton, CUDA;
- ``objective``: the value the run returned to Hydra's sweeper.

This module needs neither Hydra nor W&B, so a report can be made wherever the files are.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

RESULT_FILE = "result.json"
RESULT_FORMAT = 1


def _throughput(result: Dict[str, Any]) -> Optional[float]:
    summary = result.get("summary") or {}
    items = summary.get("steady_items_per_s")
    return items if items is not None else summary.get("steady_samples_per_s")


def _train_time(result: Dict[str, Any]) -> Optional[float]:
    summary = result.get("summary") or {}
    step, steady = summary.get("steady_step_time_s"), summary.get("steady_steps")
    if summary.get("compile_steps_time_s") is None or (steady and step is None):
        return None
    warmup = summary.get("warmup_steps_time_s") or 0.0  # the step whose FLOPs were counted, if it compiled nothing
    eager = summary.get("eager_steps_time_s") or 0.0  # the eager reference steps train too
    return eager + summary["compile_steps_time_s"] + warmup + (step or 0.0) * (steady or 0)


def final_loss(result: Dict[str, Any]) -> Optional[float]:
    """The validation loss at the end of the run, or the last training loss where there is none."""
    val = result.get("final_val_loss")
    return val if val is not None else result.get("final_train_loss")


@dataclass(frozen=True)
class Objective:
    """A number that ranks runs: ``read(result)`` and which way is better."""

    description: str
    maximize: bool
    read: Callable[[Dict[str, Any]], Optional[float]]


OBJECTIVES: Dict[str, Objective] = {
    "throughput": Objective("steady throughput", True, _throughput),
    "compile_time": Objective("compile time", False, lambda r: (r.get("summary") or {}).get("compile_time_s")),
    "train_time": Objective("time of the training steps, compiling included", False, _train_time),
    "memory": Objective("peak device memory", False, lambda r: (r.get("summary") or {}).get("peak_memory_bytes")),
    "loss": Objective("final loss (validation, else training)", False, final_loss),
}


def objective_value(result: Dict[str, Any], name: str) -> Optional[float]:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}. Valid objectives: {', '.join(OBJECTIVES)}.")
    return OBJECTIVES[name].read(result)


def device_description(device: Any) -> Dict[str, Any]:
    """The device a run trained on, in words: ``{"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1}``."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count()}
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        name = platform.processor() or platform.machine()
        return {"type": "cpu", "name": f"CPU {name}, {cores} cores, {torch.get_num_threads()} threads", "count": 1}
    return {"type": device.type, "name": device.type, "count": 1}


def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def versions() -> Dict[str, Optional[str]]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton") or _version("pytorch-triton"),
        "lightning": _version("lightning"),
        "hydra": _version("hydra-core"),
    }


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by ``None`` (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def distributed_metrics(summary: Dict[str, Any]) -> Dict[str, float]:
    """A distributed run's per-rank figures and link as logger metrics: ``ranks/<figure>/rank<N>`` for each
    ``*_by_rank`` list of ``summary["ranks"]``, ``link/...`` for the step's communication (empty on one process)."""
    metrics: Dict[str, float] = {}
    for key, values in (summary.get("ranks") or {}).items():
        if key.endswith("_by_rank") and isinstance(values, list):
            figure = key.removesuffix("_by_rank")
            numbers = [(rank, v) for rank, v in enumerate(values) if isinstance(v, (int, float))]
            metrics |= {f"ranks/{figure}/rank{rank}": float(value) for rank, value in numbers}
    link = summary.get("link") or {}
    for key in ("bytes_per_step", "link_time_s", "serial_time_s"):
        if isinstance(link.get(key), (int, float)):
            metrics[f"link/{key}"] = float(link[key])
    for collective, rate in ((link.get("probe") or {}).get("busbw_gbps_largest") or {}).items():
        metrics[f"link/busbw_gbps/{collective}"] = float(rate)
    return metrics


def write_result(run_dir: Union[str, Path], result: Dict[str, Any], rank: int = 0) -> Path:
    """Write ``result.json`` atomically (a report never reads half a file); another rank than 0 (a failure of its
    own) writes ``result.rank<N>.json`` beside it."""
    path = Path(run_dir) / (RESULT_FILE if rank == 0 else f"result.rank{rank}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(_finite({"format": RESULT_FORMAT, **result}), indent=2, default=str) + "\n")
    partial.replace(path)
    return path


def read_result(path: Union[str, Path]) -> Dict[str, Any]:
    path = Path(path)
    result = json.loads(path.read_text())
    if not isinstance(result, dict) or result.get("format") != RESULT_FORMAT:
        raise ValueError(f"{path} is not a compile_trainer result file of format {RESULT_FORMAT}")
    return result
