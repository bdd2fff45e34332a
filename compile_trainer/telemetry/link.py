"""The link between ranks, measured: collective bus bandwidth over the default process group, and the GPU topology
as ``nvidia-smi topo -m`` reports it.

Bus bandwidth as NCCL's tests define it: a collective over ``n`` ranks on a message of ``S`` bytes (the whole
reduced or gathered tensor) that takes ``t`` seconds runs at ``S / t * factor``, the factor 2(n-1)/n for an
all-reduce and (n-1)/n for an all-gather or a reduce-scatter. It is the rate each rank's link carries, the same
scale for every collective and world size, and what to hold against the link's peak.

``probe_link`` is a collective (every rank calls it with the same requests); ``LinkProbe`` and
``parse_topology`` are pure.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
Request = Tuple[str, str, int]  # collective, dtype name, bytes


def bus_factor(collective: str, world_size: int) -> float:
    """The share of a message each rank's link carries (NCCL's tests' busbw over algbw)."""
    share = (world_size - 1) / world_size
    return {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share}[collective]


def size_text(nbytes: float) -> str:
    """``158 MB``, ``1.49 GB``, ``139 kB`` (powers of 1000, as bandwidths are counted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def dtype_name(dtype: Union[torch.dtype, str]) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Measurement:
    """One collective at one size: seconds an operation (the slowest rank's mean) and its bus bandwidth."""

    collective: str
    dtype: str
    bytes: int
    seconds: float
    busbw: float  # bytes per second


@dataclass
class LinkProbe:
    """Measured bus bandwidths; ``busbw`` and ``seconds`` at any size from them."""

    world_size: int
    backend: str
    measurements: List[Measurement]

    def busbw(self, collective: str, nbytes: float, dtype: Optional[str] = None) -> Optional[float]:
        """Bytes a second at ``nbytes``: interpolated (log of the size) between the sizes measured, those of the
        nearest size beyond them; the measurements in ``dtype`` where there are any."""
        points = [m for m in self.measurements if m.collective == collective]
        points = [m for m in points if m.dtype == dtype] or points
        by_size: Dict[int, List[float]] = {}
        for m in points:
            by_size.setdefault(m.bytes, []).append(m.busbw)
        sizes = sorted(by_size)
        if not sizes:
            return None
        rate = {size: sum(rates) / len(rates) for size, rates in by_size.items()}
        if nbytes <= sizes[0] or nbytes >= sizes[-1]:
            return rate[sizes[0] if nbytes <= sizes[0] else sizes[-1]]
        upper = next(i for i, size in enumerate(sizes) if size >= nbytes)
        low, high = sizes[upper - 1], sizes[upper]
        weight = math.log(nbytes / low) / math.log(high / low)
        return rate[low] + weight * (rate[high] - rate[low])

    def seconds(self, collective: str, nbytes: float, dtype: Optional[str] = None) -> Optional[float]:
        """The time a message of ``nbytes`` takes at the measured bus bandwidth (None where not measured)."""
        rate = self.busbw(collective, nbytes, dtype)
        return nbytes * bus_factor(collective, self.world_size) / rate if rate else None

    def largest(self) -> Dict[str, float]:
        """Each collective's bus bandwidth at the largest size measured (GB/s)."""
        found = {}
        for collective in COLLECTIVES:
            points = [m for m in self.measurements if m.collective == collective]
            if points:
                found[collective] = round(self.busbw(collective, max(m.bytes for m in points)) / 1e9, 2)
        return found

    def describe(self) -> str:
        """``all-reduce 250 GB/s, ... (bus bandwidth at 1.05 MB to 158 MB)``."""
        if not self.measurements:
            return "nothing measured"
        rates = ", ".join(f"{name.replace('_', '-')} {rate:.3g} GB/s" for name, rate in self.largest().items())
        low, high = (size_text(f(m.bytes for m in self.measurements)) for f in (min, max))
        return f"{rates} (bus bandwidth at {low if low == high else f'{low} to {high}'})"

    def as_dict(self) -> Dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend, "busbw_gbps_largest": self.largest()} | {
            "measurements": [asdict(m) for m in self.measurements]
        }


def grid(collectives: Sequence[str], dtypes: Sequence[str], sizes: Sequence[int]) -> List[Request]:
    """Every collective in every dtype at every size."""
    return [(c, d, s) for c in collectives for d in dtypes for s in sizes]


def probe_link(
    requests: Sequence[Request], device: Optional[torch.device] = None, warmup: int = 2, iterations: int = 5
) -> LinkProbe:
    """Each request's collective timed over the default process group: ``warmup`` operations, then the mean of
    ``iterations``; the slowest rank's time counts (one more all-reduce, so that every rank gets the same figures).
    A collective: every rank calls it with the same requests."""
    world, backend = dist.get_world_size(), str(dist.get_backend())
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    seconds, sized = [], []
    for collective, dtype, nbytes in requests:
        kind = DTYPES[dtype]
        numel = max(world, nbytes // kind.itemsize // world * world)
        whole = torch.zeros(numel, dtype=kind, device=device)
        shard = torch.zeros(numel // world, dtype=kind, device=device)
        seconds.append(_timed(_operation(collective, whole, shard), device, warmup, iterations))
        sized.append((collective, dtype, numel * kind.itemsize))
        del whole, shard
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    if slowest.numel():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    measurements = [
        Measurement(c, d, b, t, b * bus_factor(c, world) / t) for (c, d, b), t in zip(sized, slowest.tolist())
    ]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return LinkProbe(world, backend, measurements)


def _operation(collective: str, whole: torch.Tensor, shard: torch.Tensor) -> Callable[[], Any]:
    """The collective on a whole message and one rank's shard of it."""
    if collective == "all_reduce":
        return partial(dist.all_reduce, whole)
    if collective == "all_gather":  # all_gather_single from torch 2.13 on (all_gather_into_tensor deprecated)
        return partial(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor, whole, shard)
    return partial(getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor, shard, whole)


def _timed(operation: Any, device: torch.device, warmup: int, iterations: int) -> float:
    for _ in range(warmup):
        operation()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        operation()
    _synchronize(device)
    return (time.perf_counter() - start) / iterations


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def gpu_topology(timeout_s: float = 10.0) -> Optional[Dict[str, Any]]:
    """``nvidia-smi topo -m`` parsed (``parse_topology``); None without nvidia-smi or GPUs."""
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_topology(done.stdout) if done.returncode == 0 else None


def parse_topology(text: str) -> Optional[Dict[str, Any]]:
    """The GPU-to-GPU links of an ``nvidia-smi topo -m`` matrix: ``links`` by pair (``GPU0-GPU1: NV18``), a one-line
    ``summary`` and the ``matrix`` itself (its legend left out); None when it names no GPU."""
    lines = ANSI.sub("", text).splitlines()
    matrix = lines[: next((i for i, line in enumerate(lines) if line.strip().startswith("Legend")), len(lines))]
    header = next((line.split() for line in matrix if "GPU0" in line.split()), None)
    if header is None:
        return None
    gpus = [token for token in header if re.fullmatch(r"GPU\d+", token)]
    rows = {tokens[0]: tokens[1 : 1 + len(gpus)] for tokens in map(str.split, matrix) if tokens and tokens[0] in gpus}
    links = {
        f"{a}-{b}": rows[a][j] for i, a in enumerate(gpus) for j, b in enumerate(gpus) if i < j and len(rows[a]) > j
    }
    kinds = sorted(set(links.values()))
    if len(kinds) == 1:
        summary = f"{kinds[0]} between every pair of {len(gpus)} GPUs"
    else:
        summary = ", ".join(f"{pair} {kind}" for pair, kind in links.items()) or f"{len(gpus)} GPU"
    return {"gpus": len(gpus), "links": links, "summary": summary, "matrix": "\n".join(matrix).strip()}
