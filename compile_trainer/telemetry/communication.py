"""What a training step sends between ranks under DDP and FSDP2, the time a measured link makes of it, and which
other strategy or setting would be faster (``LinkPlan``: the plan's link line on several ranks).

Message sizes as NCCL's tests count them (the whole reduced or gathered tensor); a message of ``S`` bytes puts
``S * bus_factor`` through each rank's link. Per step, for the parameters of a model:

- DDP: an all-reduce of the gradients (in the parameters' dtype: float32 under bf16-mixed autocast) in buckets
  filled from the last parameter (backward's order): the first 1 MiB, then ``bucket_cap_mb`` (25 MiB); a parameter
  larger than a bucket is one of its own. The last bucket, the first parameters' gradients, has nothing left to
  overlap with.
- FSDP2 (each ``fully_shard`` unit, the root first): an all-gather of the unit's parameters in the forward (in the
  ``MixedPrecisionPolicy``'s ``param_dtype``), again in the backward for a unit that resharded after its forward
  (``reshard_after_forward``; never the root), and a reduce-scatter of its gradients (``reduce_dtype``). The root's
  all-gather comes before any compute and its reduce-scatter after the last: neither can overlap.

An all-reduce is a reduce-scatter and an all-gather: FSDP2 gathering bf16 and reducing fp32 puts as many bytes
through the link as DDP's fp32 all-reduce (fp32 parameters: 1.5 times as many; no reshard: 0.75 times).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from compile_trainer.telemetry.link import LinkProbe, Request, bus_factor, size_text

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = MIB  # DDP's first bucket (torch.distributed's default), then bucket_cap_mb
DDP_BUCKET_BYTES = 25 * MIB  # DistributedDataParallel's bucket_cap_mb default
# A DDP rank holds the weights, the gradients and AdamW's two moments in float32: 16 bytes a parameter. The model
# "fits" DDP where they take at most half the device's memory (the rest for activations).
DDP_BYTES_PER_PARAMETER = 16
DDP_MEMORY_SHARE = 0.5
SAME_TIME = 1.1  # a setting within 10% of the current link time is no slower on the link
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
FSDP2_SETTINGS_ATTR = "_compile_trainer_fsdp2"  # where compile_and_shard records its settings on the module


@dataclass(frozen=True)
class Fsdp2Settings:
    """How FSDP2 sharded a model: its mixed-precision dtypes, resharding and explicit forward prefetch. ``assumed``:
    not recorded (FSDP2's defaults: no casting, every unit but the root resharded)."""

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    reshard_last_block: bool = True  # compile_and_shard keeps the last block gathered: the backward starts there
    forward_prefetch: int = 0
    assumed: bool = False

    def describe(self) -> str:
        reshard = "no reshard after forward"
        if self.reshard_after_forward:
            reshard = "reshard after forward" + ("" if self.reshard_last_block else " (not the last block)")
        prefetch = f", forward prefetch {self.forward_prefetch}" if self.forward_prefetch else ""
        assumed = " (assumed: not sharded by compile_and_shard)" if self.assumed else ""
        dtypes = f"{SHORT[self.param_dtype]} parameters, {SHORT[self.reduce_dtype]} reduction"
        return f"{dtypes}, {reshard}{prefetch}{assumed}"


@dataclass(frozen=True)
class Message:
    collective: str
    dtype: str
    bytes: int
    serial: bool = False  # nothing to overlap with: the step waits for all of it


@dataclass
class StepCommunication:
    """The messages of one training step under one strategy and setting."""

    strategy: str
    setting: str
    world_size: int
    messages: List[Message]
    serial_what: str = ""  # which messages are serial, in words

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.messages)

    def bytes_by_collective(self) -> Dict[str, int]:
        found: Dict[str, int] = {}
        for m in self.messages:
            found[m.collective] = found.get(m.collective, 0) + m.bytes
        return found

    def link_bytes(self) -> float:
        """What each rank's link carries a step."""
        return sum(m.bytes * bus_factor(m.collective, self.world_size) for m in self.messages)

    def seconds(self, probe: LinkProbe, serial_only: bool = False) -> Optional[float]:
        """The step's messages at the probe's bus bandwidths, one after the other (None where not measured)."""
        times = [probe.seconds(m.collective, m.bytes, m.dtype) for m in self.messages if m.serial or not serial_only]
        return None if None in times else sum(times)

    def describe(self) -> str:
        return f"{self.strategy} ({self.setting})"


@dataclass
class ModelShape:
    """What decides a step's communication: the parameters (registration order, shared ones once) and their dtype,
    the world size, FSDP2's units (each one's parameters, the root first) and settings, DDP's bucket size."""

    param_numels: List[int]
    param_dtype: str
    world_size: int
    units: Optional[List[int]] = None
    fsdp2: Fsdp2Settings = field(default_factory=Fsdp2Settings)
    bucket_bytes: int = DDP_BUCKET_BYTES
    device_memory_bytes: Optional[int] = None

    @property
    def parameters(self) -> int:
        return sum(self.param_numels)


def ddp_step(shape: ModelShape) -> StepCommunication:
    """DDP's all-reduce of the gradients, bucket by bucket (module docstring)."""
    itemsize, buckets, filled, cap = ITEMSIZE[shape.param_dtype], [], 0, DDP_FIRST_BUCKET_BYTES
    for numel in reversed(shape.param_numels):
        filled += numel * itemsize
        if filled >= cap:
            buckets.append(filled)
            filled, cap = 0, shape.bucket_bytes
    buckets += [filled] if filled else []
    last = len(buckets) - 1
    messages = [Message("all_reduce", shape.param_dtype, size, serial=i == last) for i, size in enumerate(buckets)]
    setting = f"{SHORT[shape.param_dtype]} gradients, {shape.bucket_bytes / MIB:g} MiB buckets"
    return StepCommunication("ddp", setting, shape.world_size, messages, "the last bucket's all-reduce")


def fsdp2_step(shape: ModelShape, settings: Optional[Fsdp2Settings] = None) -> StepCommunication:
    """FSDP2's all-gathers and reduce-scatters, unit by unit (module docstring)."""
    settings = settings or shape.fsdp2
    units = shape.units or [shape.parameters]
    gather, reduce = ITEMSIZE[settings.param_dtype], ITEMSIZE[settings.reduce_dtype]
    messages = []
    for index, numel in enumerate(units):
        root, last = index == 0, index == len(units) - 1
        if not numel:
            continue
        messages.append(Message("all_gather", settings.param_dtype, numel * gather, serial=root))
        if settings.reshard_after_forward and not root and (settings.reshard_last_block or not last):
            messages.append(Message("all_gather", settings.param_dtype, numel * gather))
        messages.append(Message("reduce_scatter", settings.reduce_dtype, numel * reduce, serial=root))
    serial = "the root's all-gather and reduce-scatter"
    return StepCommunication("fsdp2", settings.describe(), shape.world_size, messages, serial)


def step_communication(kind: str, shape: ModelShape) -> StepCommunication:
    """The step's messages under strategy ``kind`` (``ddp`` or ``fsdp2``)."""
    return fsdp2_step(shape) if kind == "fsdp2" else ddp_step(shape)


def probe_requests(steps: Sequence[StepCommunication], max_bytes: int, sizes_per_collective: int = 2) -> List[Request]:
    """What a short probe measures for ``steps``: for each collective and dtype, the message sizes that carry the
    most bytes (at most ``sizes_per_collective``, none above ``max_bytes``: larger ones take the largest's rate)."""
    carried: Dict[tuple, Dict[int, int]] = {}
    for step in steps:
        for m in step.messages:
            sizes = carried.setdefault((m.collective, m.dtype), {})
            sizes[min(m.bytes, max_bytes)] = sizes.get(min(m.bytes, max_bytes), 0) + m.bytes
    requests = []
    for (collective, dtype), sizes in carried.items():
        heaviest = sorted(sizes, key=sizes.get, reverse=True)[:sizes_per_collective]
        requests += [(collective, dtype, size) for size in sorted(heaviest)]
    return requests


@dataclass(frozen=True)
class Suggestion:
    """A setting that would be faster than the current one: its name, its link time a step and why."""

    setting: str
    seconds: Optional[float]
    why: str


@dataclass
class LinkPlan:
    """The measured link and the step's communication under ``kind``; ``compute_s`` (a step's compute, where
    known) decides whether the link dominates."""

    kind: str
    shape: ModelShape
    probe: LinkProbe
    topology: Optional[str] = None
    compute_s: Optional[float] = None

    @property
    def current(self) -> StepCommunication:
        return step_communication(self.kind, self.shape)

    def faster(self) -> List[Suggestion]:
        """The settings that would be faster, the fastest on the link first."""
        current, suggestions = self.current, []
        seconds = current.seconds(self.probe)
        if self.kind == "fsdp2":
            suggestions += self._fsdp2_alternatives(seconds)
        if self.compute_s and seconds and seconds > self.compute_s:
            times = math.ceil(seconds / self.compute_s)
            suggestions.append(Suggestion(
                f"a batch {times}x larger a rank", seconds,
                f"the link takes {seconds * 1e3:.3g} ms a step, compute {self.compute_s * 1e3:.3g} ms: the same "
                f"bytes move for {times}x the samples (or accumulate gradients: trainer.accumulate_grad_batches)",
            ))  # fmt: skip
        return sorted(suggestions, key=lambda s: s.seconds if s.seconds is not None else math.inf)

    def _fsdp2_alternatives(self, seconds: Optional[float]) -> List[Suggestion]:
        shape, settings, found = self.shape, self.shape.fsdp2, []
        ddp = ddp_step(shape).seconds(self.probe)
        state = shape.parameters * DDP_BYTES_PER_PARAMETER
        memory = shape.device_memory_bytes
        fits = memory is None or state <= DDP_MEMORY_SHARE * memory
        if fits and ddp is not None and seconds is not None and ddp <= SAME_TIME * seconds:
            state_text = f"training state ({DDP_BYTES_PER_PARAMETER} B a parameter: {size_text(state)})"
            fit = f"its {state_text} fits" if memory else f"if its {state_text} fits one device"
            found.append(Suggestion(
                "DDP (trainer=gpu_ddp)", ddp,
                f"{_ms(ddp)} on the link against {_ms(seconds)}, without FSDP2's all-gather and reshard around every "
                f"block; {fit} with room for activations",
            ))  # fmt: skip
        if settings.param_dtype == "float32":
            mixed = replace(settings, param_dtype="bfloat16", assumed=False)
            time = fsdp2_step(shape, mixed).seconds(self.probe)
            found.append(Suggestion(
                "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)", time,
                f"all-gathers bf16 parameters, half the bytes: {_ms(time)} on the link against {_ms(seconds)}",
            ))  # fmt: skip
        if settings.reshard_after_forward:
            kept = fsdp2_step(shape, replace(settings, reshard_after_forward=False, assumed=False))
            time = kept.seconds(self.probe)
            # what the backward gathers again stays gathered instead: all of it but this rank's shard
            again = fsdp2_step(shape).bytes_by_collective()["all_gather"] - kept.bytes_by_collective()["all_gather"]
            extra = again * (shape.world_size - 1) / shape.world_size
            found.append(Suggestion(
                "reshard_after_forward=False", time,
                f"no all-gather in the backward: {_ms(time)} on the link against {_ms(seconds)}, for "
                f"{size_text(extra)} more memory a rank (the gathered blocks kept from forward to backward)",
            ))  # fmt: skip
        return found

    def as_dict(self) -> Dict[str, Any]:
        current = self.current
        seconds, serial = current.seconds(self.probe), current.seconds(self.probe, serial_only=True)
        return {
            "strategy": self.kind,
            "setting": current.setting,
            "world_size": self.shape.world_size,
            "parameters": self.shape.parameters,
            "bytes_per_step": current.bytes,
            "bytes_by_collective": current.bytes_by_collective(),
            "link_bytes_per_rank": current.link_bytes(),
            "link_time_s": seconds,
            "serial_time_s": serial,
            "compute_s": self.compute_s,
            "topology": self.topology,
            "probe": self.probe.as_dict(),
            "faster": [asdict(s) for s in self.faster()],
        }


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def format_link_plan(plan: LinkPlan) -> str:
    """The plan's link lines: what the link allows, what a step costs on it, what would be faster."""
    current = plan.current
    seconds, serial = current.seconds(plan.probe), current.seconds(plan.probe, serial_only=True)
    where = f" ({plan.topology})" if plan.topology else ""
    collectives = ", ".join(f"{k.replace('_', '-')} {size_text(v)}" for k, v in current.bytes_by_collective().items())
    lines = [
        f"link: {plan.probe.world_size} ranks over {plan.probe.backend}{where}: {plan.probe.describe()}",
        f"  {current.describe()}: {size_text(current.bytes)} a step ({collectives}), {_ms(seconds)} at these rates, "
        f"{_ms(serial)} of it with nothing to overlap ({current.serial_what})",
    ]
    faster = plan.faster()
    lines += [f"  faster: {s.setting}: {s.why}" for s in faster] or ["  faster: none on this link"]
    return "\n".join(lines)


def fsdp2_units(model: nn.Module) -> List[int]:
    """Each ``fully_shard`` unit's own parameters (not those of units inside it; shared ones once), the outermost
    first, as ``fsdp2_step`` takes them; empty when nothing is sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    seen, owned = set(), []
    for unit in reversed(units):  # inner units first (after their outer one in modules()): each owns what is left
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in params}
        owned.append(sum(p.numel() for p in params))
    return owned[::-1]
