"""Where a training step's host time goes, on rank 0: torch.profiler's CPU events over ``HOST_STEPS`` steps, in ms a
step: the step's wall time, FSDP2's hooks (its ``FSDP::`` ranges, each counted where no other encloses it) and the
ops with the most self time (DTensor's Python dispatch shows as ``PythonSubclass``). A step whose GPU sits idle
(``gpu_timeline_ms_a_step``) is bound by this time; a window of its own, before the GPU profile's, so that the CPU
events' overhead does not lengthen the GPU's idle time there.
"""

import time
from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch

HOST_STEPS = 3
TOP_OPS = 10


class HostProfiledSteps(pl.Callback):
    """Rank 0's CPU events over ``HOST_STEPS`` steps from step ``first``, read into ``breakdown``
    (``host_breakdown``)."""

    def __init__(self, first: int) -> None:
        self.first = max(first, 1)
        self.profiler: Any = None
        self.started = 0.0
        self.breakdown: Optional[Dict[str, Any]] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.first and trainer.global_rank == 0:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.profiler is None or batch_idx != self.first + HOST_STEPS - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        self.breakdown = host_breakdown(self.profiler.events(), HOST_STEPS, wall)
        self.profiler = None


def host_breakdown(events: Any, steps: int, wall_s: float) -> Dict[str, Any]:
    """``wall``, ``fsdp_hooks`` and ``top_self`` (name -> self CPU time) in ms a step, from a profile's
    ``FunctionEvent``s over ``steps`` steps that took ``wall_s``."""

    def fsdp(event: Any) -> bool:
        return event.name.startswith("FSDP::")

    def enclosed_by_fsdp(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if fsdp(parent):
                return True
            parent = parent.cpu_parent
        return False

    hooks_us = sum(e.cpu_time_total for e in events if fsdp(e) and not enclosed_by_fsdp(e))
    self_us: Dict[str, float] = {}
    for event in events:
        self_us[event.name] = self_us.get(event.name, 0.0) + event.self_cpu_time_total
    top = sorted(self_us.items(), key=lambda item: -item[1])[:TOP_OPS]
    return {
        "wall": round(wall_s * 1e3 / steps, 3),
        "fsdp_hooks": round(hooks_us / 1e3 / steps, 3),
        "top_self": {name: round(us / 1e3 / steps, 3) for name, us in top},
    }
