"""Step clocks of the throughput meter: ``start()``, ``stop(tag)``, then ``completed(wait)`` gives (seconds, tag) of
the steps whose times are known. On CUDA the times are the GPU's, between two events on the current stream, read
back once they have completed (``wait``: synchronize on the last one), so that timing adds no synchronization."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

import torch


class HostClock:
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


class CudaClock:
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
