"""``compile: auto``: the candidates (``fused``, ``foreach``, ``compiled``) timed on the real parameters during the
first steps of training; the fastest is kept and reported as an ``OptimizerChoice``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence

import torch

from compile_trainer import compat

if TYPE_CHECKING:
    from compile_trainer.optimizer.compiled_step import CompiledOptimizerStep

log = logging.getLogger(__name__)


@dataclass
class OptimizerChoice:
    """What ``compile: auto`` measured and chose."""

    chosen: str
    step_ms: Dict[str, float]  # fastest timed update per candidate (device time from the end of backward)
    skipped: Dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    device: str = "cpu"
    timed_steps: int = 0
    clipping: str = "none"  # every candidate's step includes it

    def describe(self) -> str:
        others = ", ".join(f"{n} {ms:.3f} ms" for n, ms in self.step_ms.items() if n != self.chosen)
        clipping = f", clipping by {self.clipping} included" if self.clipping != "none" else ""
        text = f"auto chose {self.chosen} ({self.step_ms[self.chosen]:.3f} ms per update{clipping}"
        text += f"{' vs ' + others if others else ''}; best of {self.timed_steps} timed steps each on {self.device})"
        return text + "".join(f"; {name} skipped: {why}" for name, why in self.skipped.items())


def _start_clock(device: torch.device) -> Any:
    """A start mark on ``device``'s timeline: a CUDA event recorded on the current stream, else the wall clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return time.perf_counter()


def _stop_clock(device: torch.device, started: Any) -> Callable[[], float]:
    """Seconds since ``started``, read later (CUDA: without a host sync until then)."""
    if device.type == "cuda":
        stopped = torch.cuda.Event(enable_timing=True)
        stopped.record()
        return lambda: (stopped.synchronize(), started.elapsed_time(stopped) / 1000)[1]
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    seconds = time.perf_counter() - started
    return lambda: seconds


class AutoTrial:
    """Runs real training steps with each candidate in turn: one warm-up step (it compiles), then timed steps.

    A timed step is what the candidate's update costs the device in training: from the end of Lightning's closure
    (forward and backward) to the end of the update, measured on the device's stream (CUDA events, read once the
    trial is over) so host time counts only where the device waits for it, as in training, where the host is
    ahead of the device at the step. (Timed with a sync around the step, the Inductor candidate won on GPT-2 small
    and trained 0.5 ms a step slower than fused: fused's higher host overhead is hidden in training. Timed with
    the closure, the 20 ms of forward and backward drowned differences of tenths of a millisecond: the Triton
    candidate, 0.25 ms a step faster than fused in training, lost its trial by 1.7 ms.) The gradient hooks are off
    meanwhile: the Inductor candidate copies the gradients into its flat buffer inside the timed step, so its time
    counts the copy, and the other candidates read each gradient where backward left it, as in training. Eager
    candidates' steps advance the state in place and leave it bound, so no candidate's step syncs with the host.
    """

    def __init__(self, step: CompiledOptimizerStep):
        self.owner = step
        self.skipped: Dict[str, str] = {}
        candidates = list(step.policy.auto_candidates)
        reason = compat.fused_unsupported_reason(step.optimizer) if "fused" in candidates else None
        if reason:
            candidates.remove("fused")
            self.skipped["fused"] = reason
        # Round robin after each candidate's warm-up: the first steps of training run slower (the model's CUDA
        # graphs are recorded, the allocator grows), and a candidate timed only then would lose for it.
        self.schedule = [(name, False) for name in candidates]
        self.schedule += [(name, True) for _ in range(step.policy.auto_steps) for name in candidates]
        self.timings: Dict[str, List[Callable[[], float]]] = {name: [] for name in candidates}
        self._started: Any = None
        self._begun = False  # the first trial step runs once every parameter has its state
        step.layout.remove_hooks()

    def start_timing(self) -> None:
        self._started = _start_clock(self.owner.device)

    def eager_candidate_next(self) -> bool:
        """Whether the next step is an eager candidate's, which then skips the gather into the flat buffers."""
        return self._begun and self.schedule[0][0] != "compiled"

    def step(self) -> None:
        name, timed = self.schedule.pop(0)
        self._begun = True
        owner = self.owner
        if name in self.timings:
            try:
                if name == "compiled":
                    owner.compiled_update()
                else:
                    owner.eager_step(f"auto is timing {name}", name)
            except Exception as error:  # a compile that fails leaves the other candidates to choose from
                if name != "compiled" or timed or len(self.timings) == 1:
                    raise
                self._drop_compiled(error)
        if name not in self.timings:  # a dropped candidate's turns still run, eagerly: every rank's trial is as long
            owner.eager_step("auto: the compiled candidate failed")
        elif timed:
            self.timings[name].append(_stop_clock(owner.device, self._started))
        if not self.schedule:
            # The best, not the median: noise (another process, a late autotune or CUDA-graph recording) only adds.
            step_ms = {name: 1000 * min(read() for read in reads) for name, reads in self.timings.items()}
            step_ms = _slowest_across_ranks(step_ms, owner.policy.auto_candidates, owner.device)
            chosen = min(step_ms, key=step_ms.__getitem__)
            choice = OptimizerChoice(chosen, step_ms, self.skipped, str(owner.device), owner.policy.auto_steps)
            owner.choose(dataclasses.replace(choice, clipping=owner.clipping))

    def _drop_compiled(self, error: Exception) -> None:
        self.skipped["compiled"] = f"compile failed: {compat.traced_error_summary(error)}"
        log.warning("optimizer %s: auto: %s", type(self.owner.optimizer).__name__, self.skipped["compiled"])
        del self.timings["compiled"]


def _slowest_across_ranks(step_ms: Dict[str, float], candidates: Sequence[str], device: torch.device):
    """Under a process group of several ranks, each candidate's slowest time over the ranks (a candidate some rank
    could not time is out everywhere), so that every rank chooses the same: replicas updated by different kernels
    would drift apart, as DDP never synchronizes parameters."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1):
        return step_ms
    on = device if distributed.get_backend() == "nccl" else torch.device("cpu")
    times = torch.tensor([step_ms.get(name, float("inf")) for name in candidates], dtype=torch.float64, device=on)
    distributed.all_reduce(times, op=distributed.ReduceOp.MAX)
    return {name: ms for name, ms in zip(candidates, times.tolist()) if ms != float("inf")}
