"""The ``shapes`` section of a policy: declarations for variable-length batches, and their pure checks.

Two remedies against recompiles on new shapes, usable together or alone:

- ``dynamic``: named batch entries get ``torch._dynamo.mark_dynamic`` on the declared dimensions (with
  optional ``min``/``max``), so the first compile is already dynamic in them.
- ``pad``: named batch entries are padded along one dimension up to the smallest bucket that fits, each
  with its own pad value (``pad_token_id`` for ids, ``0``/``False`` for masks, ``ignore_index`` for labels).

What applies them to batches: ``compile_trainer.shapes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

OVERFLOW_POLICIES = ("error", "truncate")
# Batch entries by role, under the names they usually have (Hugging Face's, then the recipes'). An entry written
# ``@role`` (``@tokens``) stands for the first of these names the batch has; roles the batch lacks are left out.
ROLE_PREFIX = "@"
ROLE_NAMES = {
    "tokens": ("input_ids", "inputs", "tokens"),
    "attention_mask": ("attention_mask",),
    "labels": ("labels", "targets"),
    "token_type_ids": ("token_type_ids",),
    "position_ids": ("position_ids",),
}


def role_of(entry: str) -> Optional[str]:
    """``"tokens"`` for ``"@tokens"``; None for an entry named directly."""
    return entry[len(ROLE_PREFIX) :] if entry.startswith(ROLE_PREFIX) else None


@dataclass
class DynamicDim:
    """A dimension of a batch entry that is compiled dynamic from the first compile.

    ``min``/``max`` bound the sizes the compiled graph accepts; a batch outside them is an error. Sizes 0
    and 1 are never marked: Dynamo specializes them, so such a batch compiles a graph of its own.
    """

    entry: str = ""
    dim: int = 1
    min: Optional[int] = None
    max: Optional[int] = None


@dataclass
class PowersOfTwo:
    min: int = 16
    max: int = 1024


@dataclass
class AutoBuckets:
    """Bucket lengths chosen from the data (``shapes.pad.auto``).

    ``count`` lengths, each a multiple of ``multiple_of``, that pad the fewest positions over the lengths of the
    first ``sample_batches`` training batches (read before training, the random state restored). The largest
    bucket holds the longest batch seen, or ``Padding.max`` where given (the model's longest input, say), so
    that a longer batch later still fits.
    """

    count: int = 4
    sample_batches: int = 64
    multiple_of: int = 8


@dataclass
class Padding:
    """Pad entries along ``dim`` up to the smallest bucket that fits.

    The buckets are given by exactly one of ``buckets`` (explicit lengths), ``multiple_of`` (every
    multiple up to ``max``, unbounded without it), ``powers_of_two`` (``min`` to ``max``) or ``auto`` (chosen
    from the data's lengths); with none, nothing is padded. ``values``
    names the entries to pad and the value for each. A batch longer than the largest bucket is an
    ``error`` or is cut to it (``truncate``), as ``overflow`` says.
    """

    dim: int = 1
    buckets: List[int] = field(default_factory=list)
    multiple_of: Optional[int] = None
    max: Optional[int] = None
    powers_of_two: Optional[PowersOfTwo] = None
    auto: Optional[AutoBuckets] = None
    values: Dict[str, Any] = field(default_factory=dict)
    overflow: str = "error"

    @property
    def enabled(self) -> bool:
        rules = (self.multiple_of, self.powers_of_two, self.auto)
        return bool(self.buckets) or any(rule is not None for rule in rules)

    @property
    def bucket_count(self) -> Optional[int]:
        """How many buckets there will be (``auto`` too, before it has chosen); ``None`` when unbounded."""
        if self.auto is not None:
            return self.auto.count
        lengths = bucket_lengths(self)
        return None if lengths is None else len(lengths)


@dataclass
class ShapesPolicy:
    """How a compile policy handles batches whose shapes vary.

    ``warmup``: compile every bucket (train and validation) after the first batch of each mode: each region
    call that compiled is compiled again at every other bucket, from its recorded inputs, without running
    (``compile_trainer.shapes.bucket_warmup``; no user code runs). ``strict_recompiles``: after warm-up, a
    recompile of a compiled region raises an error naming the region and the guard that failed.
    ``mark_region_inputs``: regional compilation sees activations, not the batch; mark an input of a compiled
    region dynamic where it has the batch's dynamic sizes at the same dimensions.
    """

    dynamic: List[DynamicDim] = field(default_factory=list)
    pad: Padding = field(default_factory=Padding)
    warmup: bool = False
    strict_recompiles: bool = False
    mark_region_inputs: bool = True

    @property
    def active(self) -> bool:
        return bool(self.dynamic or self.pad.enabled or self.warmup or self.strict_recompiles)


def bucket_lengths(pad: Padding) -> Optional[List[int]]:
    """The bucket lengths in increasing order; ``None`` when unbounded (``multiple_of`` without ``max``) or
    chosen from the data (``auto``: ``compile_trainer.shapes.buckets``)."""
    if pad.auto is not None:
        return None
    if pad.buckets:
        return list(pad.buckets)
    if pad.multiple_of is not None:
        if pad.max is None:
            return None
        return list(range(pad.multiple_of, pad.max + 1, pad.multiple_of))
    lengths, length = [], pad.powers_of_two.min
    while length <= pad.powers_of_two.max:
        lengths.append(length)
        length *= 2
    return lengths


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def padding_problems(pad: Padding) -> List[str]:
    kinds = ("buckets", "multiple_of", "powers_of_two", "auto")
    rules = [name for name in kinds if getattr(pad, name) not in (None, [])]
    if not rules:  # padding is off; values alone are a mistake
        if pad.values:
            return ["shapes.pad.values are given but no buckets: give buckets, multiple_of, powers_of_two or auto"]
        return []
    if len(rules) > 1:
        return [f"shapes.pad: give one of {', '.join(kinds)}, not {' and '.join(rules)}"]
    if pad.buckets:
        if any(length < 1 for length in pad.buckets):
            return [f"shapes.pad.buckets must be positive lengths, got {list(pad.buckets)}"]
        if any(b <= a for a, b in zip(pad.buckets, pad.buckets[1:])):
            return [f"shapes.pad.buckets must be sorted ascending without repeats, got {list(pad.buckets)}"]
    if pad.multiple_of is not None and pad.multiple_of < 1:
        return [f"shapes.pad.multiple_of must be >= 1, got {pad.multiple_of}"]
    if pad.multiple_of is not None and pad.max is not None and pad.max < pad.multiple_of:
        return [f"shapes.pad.max ({pad.max}) is smaller than multiple_of ({pad.multiple_of})"]
    if pad.powers_of_two is not None:
        low, high = pad.powers_of_two.min, pad.powers_of_two.max
        if not (_is_power_of_two(low) and _is_power_of_two(high) and low <= high):
            return [f"shapes.pad.powers_of_two needs powers of two with min <= max, got min={low} max={high}"]
    problems = _auto_problems(pad.auto, pad.max) if pad.auto is not None else []
    if pad.overflow not in OVERFLOW_POLICIES:
        problems.append(f"shapes.pad.overflow {pad.overflow!r} is invalid; valid: {', '.join(OVERFLOW_POLICIES)}")
    if not pad.values:
        problems.append(
            "shapes.pad.values is empty: name each entry to pad and its pad value, "
            "e.g. {input_ids: 0, attention_mask: false, labels: -100}"
        )
    for entry, value in pad.values.items():
        problems += _role_problems(f"shapes.pad.values[{entry!r}]", entry)
        if value is None:
            problems.append(
                f"shapes.pad.values: missing pad value for entry {entry!r}; give pad_token_id for ids, "
                "0/false for masks, ignore_index (e.g. -100) for labels"
            )
        elif not isinstance(value, (bool, int, float)):
            problems.append(f"shapes.pad.values: pad value for entry {entry!r} must be a number or bool, got {value!r}")
    return problems


def _auto_problems(auto: AutoBuckets, longest: Optional[int]) -> List[str]:
    problems = []
    for name in ("count", "sample_batches", "multiple_of"):
        if getattr(auto, name) < 1:
            problems.append(f"shapes.pad.auto.{name} must be >= 1, got {getattr(auto, name)}")
    if longest is not None and longest % max(auto.multiple_of, 1):
        problems.append(f"shapes.pad.max ({longest}) must be a multiple of auto.multiple_of ({auto.multiple_of})")
    return problems


def _role_problems(where: str, entry: str) -> List[str]:
    role = role_of(entry)
    if role is None or role in ROLE_NAMES:
        return []
    roles = ", ".join(ROLE_PREFIX + name for name in ROLE_NAMES)
    return [f"{where}: unknown role {entry!r}; roles: {roles} (or name the entry itself, e.g. input_ids)"]


def dynamic_problems(dims: List[DynamicDim], pad: Padding) -> List[str]:
    problems = []
    buckets = bucket_lengths(pad) if pad.enabled and not padding_problems(pad) else None
    for index, spec in enumerate(dims):
        where = f"shapes.dynamic[{index}] ({spec.entry!r}, dim {spec.dim})"
        if not spec.entry:
            problems.append(f"shapes.dynamic[{index}]: give `entry`, the batch entry to mark (e.g. input_ids)")
        problems += _role_problems(where, spec.entry)
        if spec.min is not None and spec.min < 2:
            problems.append(
                f"{where}: min must be >= 2, got {spec.min}; Dynamo specializes sizes 0 and 1 "
                "(a batch with such a size compiles a graph of its own)"
            )
        if spec.min is not None and spec.max is not None and spec.max < spec.min:
            problems.append(f"{where}: max ({spec.max}) is smaller than min ({spec.min})")
        if buckets and spec.entry in pad.values and spec.dim == pad.dim:
            low = [b for b in buckets if spec.min is not None and b < spec.min]
            high = [b for b in buckets if spec.max is not None and b > spec.max]
            if low:
                problems.append(f"{where}: bucket {low[0]} is smaller than min {spec.min}")
            if high:
                problems.append(f"{where}: bucket {high[0]} is larger than max {spec.max}")
    return problems


def _range(spec: DynamicDim) -> str:
    bounds = ([f"min {spec.min}"] if spec.min is not None else []) + (
        [f"max {spec.max}"] if spec.max is not None else []
    )
    return f" ({', '.join(bounds)})" if bounds else ""


def describe_shapes(shapes: ShapesPolicy) -> str:
    """One line for the plan table."""
    parts = []
    if shapes.dynamic:
        marks = [f"{d.entry}[{d.dim}]" + _range(d) for d in shapes.dynamic]
        parts.append("mark_dynamic " + ", ".join(marks))
    if shapes.pad.enabled:
        buckets = bucket_lengths(shapes.pad)
        lengths = buckets if buckets is not None else f"multiples of {shapes.pad.multiple_of}"
        if shapes.pad.auto is not None:
            auto = shapes.pad.auto
            lengths = f"{auto.count} chosen from the first {auto.sample_batches} training batches' lengths"
        parts.append(f"pad {', '.join(shapes.pad.values)} at dim {shapes.pad.dim} to buckets {lengths}")
    if shapes.warmup:
        parts.append("warm-up of every bucket after the first step")
    if shapes.strict_recompiles:
        parts.append("recompiles after warm-up are errors")
    return "shapes: " + "; ".join(parts)
