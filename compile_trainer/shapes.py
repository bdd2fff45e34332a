"""Variable-length batches: the policy's ``shapes`` section and the batch transforms it declares.

Two remedies against recompiles on new shapes, usable together or alone:

- ``dynamic``: named batch entries get ``torch._dynamo.mark_dynamic`` on the declared dimensions (with
  optional ``min``/``max``), so the first compile is already dynamic in them.
- ``pad``: named batch entries are padded along one dimension up to the smallest bucket that fits, each
  with its own pad value (``pad_token_id`` for ids, ``0``/``False`` for masks, ``ignore_index`` for labels).

``BatchShaper`` applies both to a batch (a tensor, or dicts, lists, tuples, named tuples and dataclasses of
them); it works without Lightning, and ``PadCollate`` does the padding in a DataLoader on the host.
Entries are named by dotted paths: dict keys, sequence indices, or field names (``inputs``, ``0``,
``features.mask``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils.data import default_collate

if TYPE_CHECKING:
    from compile_trainer.policy import CompilePolicy

OVERFLOW_POLICIES = ("error", "truncate")


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
class Padding:
    """Pad entries along ``dim`` up to the smallest bucket that fits.

    The buckets are given by exactly one of ``buckets`` (explicit lengths), ``multiple_of`` (every
    multiple up to ``max``, unbounded without it) or ``powers_of_two`` (``min`` to ``max``); with none,
    nothing is padded. ``values``
    names the entries to pad and the value for each. A batch longer than the largest bucket is an
    ``error`` or is cut to it (``truncate``), as ``overflow`` says.
    """

    dim: int = 1
    buckets: List[int] = field(default_factory=list)
    multiple_of: Optional[int] = None
    max: Optional[int] = None
    powers_of_two: Optional[PowersOfTwo] = None
    values: Dict[str, Any] = field(default_factory=dict)
    overflow: str = "error"

    @property
    def enabled(self) -> bool:
        return bool(self.buckets or self.multiple_of is not None or self.powers_of_two is not None)


@dataclass
class ShapesPolicy:
    """How a compile policy handles batches whose shapes vary.

    ``warmup``: compile every bucket (train and validation) at the first batch of each, before the first
    real step. ``strict_recompiles``: after warm-up, a recompile of a compiled region raises an error
    naming the region and the guard that failed. ``mark_region_inputs``: regional compilation sees
    activations, not the batch; mark an input of a compiled region dynamic where it has the batch's
    dynamic sizes at the same dimensions.
    """

    dynamic: List[DynamicDim] = field(default_factory=list)
    pad: Padding = field(default_factory=Padding)
    warmup: bool = False
    strict_recompiles: bool = False
    mark_region_inputs: bool = True

    @property
    def active(self) -> bool:
        return bool(self.dynamic or self.pad.enabled or self.warmup or self.strict_recompiles)


class ShapeError(ValueError):
    """A batch that does not fit the policy's ``shapes`` section."""


# ---------------------------------------------------------------------------------------------------------
# Policy validation


def bucket_lengths(pad: Padding) -> Optional[List[int]]:
    """The bucket lengths in increasing order; ``None`` when unbounded (``multiple_of`` without ``max``)."""
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


def _padding_problems(pad: Padding) -> List[str]:
    rules = [name for name in ("buckets", "multiple_of", "powers_of_two") if getattr(pad, name) not in (None, [])]
    if not rules:  # padding is off; values alone are a mistake
        if pad.values:
            return ["shapes.pad.values are given but no buckets: give buckets, multiple_of or powers_of_two"]
        return []
    if len(rules) > 1:
        return [f"shapes.pad: give one of buckets, multiple_of, powers_of_two, not {' and '.join(rules)}"]
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
    problems = []
    if pad.overflow not in OVERFLOW_POLICIES:
        problems.append(f"shapes.pad.overflow {pad.overflow!r} is invalid; valid: {', '.join(OVERFLOW_POLICIES)}")
    if not pad.values:
        problems.append(
            "shapes.pad.values is empty: name each entry to pad and its pad value, "
            "e.g. {input_ids: 0, attention_mask: false, labels: -100}"
        )
    for entry, value in pad.values.items():
        if value is None:
            problems.append(
                f"shapes.pad.values: missing pad value for entry {entry!r}; give pad_token_id for ids, "
                "0/false for masks, ignore_index (e.g. -100) for labels"
            )
        elif not isinstance(value, (bool, int, float)):
            problems.append(f"shapes.pad.values: pad value for entry {entry!r} must be a number or bool, got {value!r}")
    return problems


def _dynamic_problems(dims: List[DynamicDim], pad: Padding) -> List[str]:
    problems = []
    buckets = bucket_lengths(pad) if pad.enabled and not _padding_problems(pad) else None
    for index, spec in enumerate(dims):
        where = f"shapes.dynamic[{index}] ({spec.entry!r}, dim {spec.dim})"
        if not spec.entry:
            problems.append(f"shapes.dynamic[{index}]: give `entry`, the batch entry to mark (e.g. input_ids)")
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


def shape_policy_problems(policy: CompilePolicy) -> List[str]:
    """What is wrong with ``policy.shapes``, as messages naming what is valid (empty when all is well)."""
    shapes = policy.shapes
    problems = _dynamic_problems(shapes.dynamic, shapes.pad) + _padding_problems(shapes.pad)
    static = [policy.dynamic is False] + [rule.dynamic is False for rule in policy.rules]
    if shapes.dynamic and any(static):
        problems.append(
            "shapes.dynamic marks dimensions dynamic, but `dynamic: false` (in the policy or a rule) makes "
            "torch.compile ignore the marks; set dynamic to null"
        )
    if shapes.strict_recompiles and not shapes.warmup:
        problems.append(
            "shapes.strict_recompiles needs shapes.warmup: true, or the first compile of a shape would fail"
        )
    if shapes.pad.enabled and not problems:
        buckets = bucket_lengths(shapes.pad)
        if buckets is None and shapes.warmup:
            problems.append("shapes.warmup needs a finite set of buckets: give shapes.pad.max with multiple_of")
        elif buckets is not None and any(static) and len(buckets) > policy.recompile_limit:
            problems.append(
                f"{len(buckets)} buckets compile {len(buckets)} static graphs per region, more than "
                f"recompile_limit ({policy.recompile_limit}); past it a region silently runs eagerly. "
                "Raise recompile_limit or use fewer buckets"
            )
    return problems


# ---------------------------------------------------------------------------------------------------------
# Batch traversal: entries by dotted path in tensors, dicts, lists, tuples, named tuples and dataclasses


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _children(node: Any) -> Iterator[Tuple[str, Any]]:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    if _is_namedtuple(node):
        return zip(node._fields, node)
    if isinstance(node, Mapping):
        return ((str(key), value) for key, value in node.items())
    if isinstance(node, (list, tuple)):
        return ((str(index), value) for index, value in enumerate(node))
    return iter(())


def batch_tensors(batch: Any, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor in ``batch`` with its dotted path."""
    if isinstance(batch, torch.Tensor):
        yield prefix, batch
        return
    for name, child in _children(batch):
        yield from batch_tensors(child, f"{prefix}.{name}" if prefix else name)


def describe_batch(batch: Any) -> str:
    """``inputs: (4, 37) int64, targets: (4, 37) int64`` for error messages."""
    items = [
        f"{path or '<batch>'}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        for path, t in batch_tensors(batch)
    ]
    return ", ".join(items) or "no tensors"


def _child_key(node: Any, segment: str) -> Any:
    """The key under which ``segment`` addresses a child of ``node``; ``KeyError`` when there is none."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        if segment in {f.name for f in dataclasses.fields(node)}:
            return segment
    elif _is_namedtuple(node) and segment in node._fields:
        return node._fields.index(segment)
    elif isinstance(node, Mapping):
        if segment in node:
            return segment
        if segment.lstrip("-").isdigit() and int(segment) in node:
            return int(segment)
    elif isinstance(node, (list, tuple)) and segment.isdigit() and int(segment) < len(node):
        return int(segment)
    raise KeyError(segment)


def _get_child(node: Any, key: Any) -> Any:
    if isinstance(key, str) and not isinstance(node, Mapping):
        return getattr(node, key)
    return node[key]


def _with_child(node: Any, key: Any, child: Any) -> Any:
    """A shallow copy of ``node`` whose child at ``key`` is ``child``; ``node`` itself is left as it was."""
    if dataclasses.is_dataclass(node):
        copied = copy.copy(node)
        object.__setattr__(copied, key, child)  # frozen dataclasses too
        return copied
    if _is_namedtuple(node):
        return node._replace(**{node._fields[key]: child})
    if isinstance(node, tuple):
        return node[:key] + (child,) + node[key + 1 :]
    copied = copy.copy(node)
    copied[key] = child
    return copied


def get_entry(batch: Any, path: str) -> torch.Tensor:
    """The tensor at ``path`` in ``batch``; ``ShapeError`` naming the entries seen when there is none."""
    node = batch
    for segment in path.split(".") if path else []:
        try:
            node = _get_child(node, _child_key(node, segment))
        except KeyError:
            raise ShapeError(f"the batch has no entry {path!r}; entries seen: {describe_batch(batch)}") from None
    if not isinstance(node, torch.Tensor):
        raise ShapeError(
            f"batch entry {path!r} is a {type(node).__name__}, not a tensor; entries seen: {describe_batch(batch)}"
        )
    return node


def replace_entries(batch: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """A copy of ``batch`` (of the same container types) with the tensors at the given paths replaced."""
    for path, tensor in tensors.items():
        batch = _replace(batch, path.split(".") if path else [], tensor)
    return batch


def _replace(node: Any, segments: List[str], value: Any) -> Any:
    if not segments:
        return value
    key = _child_key(node, segments[0])
    return _with_child(node, key, _replace(_get_child(node, key), segments[1:], value))


def _check_dim(path: str, tensor: torch.Tensor, dim: int, batch: Any) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ShapeError(
            f"batch entry {path!r} has shape {tuple(tensor.shape)}: dim {dim} does not exist; "
            f"entries seen: {describe_batch(batch)}"
        )
    return dim % tensor.dim()


# ---------------------------------------------------------------------------------------------------------
# The transforms


def pad_to_length(tensor: torch.Tensor, dim: int, length: int, value: Any) -> torch.Tensor:
    """``tensor`` padded with ``value`` (or cut) along ``dim`` to ``length``, contiguous.

    Contiguous because a static graph also guards on strides: a batch that is a slice of a larger
    tensor would otherwise compile a graph of its own even at a bucket's exact length.
    """
    current = tensor.shape[dim]
    if current == length:
        return tensor.contiguous()
    if current > length:
        return tensor.narrow(dim, 0, length).contiguous()
    shape = list(tensor.shape)
    shape[dim] = length
    padded = tensor.new_full(shape, value)
    padded.narrow(dim, 0, current).copy_(tensor)
    return padded


def _check_value(path: str, tensor: torch.Tensor, value: Any) -> None:
    is_integral = not (tensor.is_floating_point() or tensor.is_complex())
    if is_integral and isinstance(value, float) and not value.is_integer():
        raise ShapeError(f"pad value {value!r} for batch entry {path!r} does not fit its dtype {tensor.dtype}")


class BatchShaper:
    """Applies a ``ShapesPolicy`` to batches: ``shaper(batch)`` pads, then marks; both also work alone.

    Padding returns a new batch of the same container types; marking marks the tensors in place. The
    shaper remembers the dynamic sizes of the last batch it marked, for ``mark_region_inputs``.
    """

    def __init__(self, shapes: ShapesPolicy):
        self.shapes = shapes
        self.buckets = bucket_lengths(shapes.pad) if shapes.pad.enabled else None
        # (dim, size) patterns of the last marked batch's dynamic entries, and the ids of its marked tensors
        # (alive while that batch is in use, so an id cannot be another tensor's meanwhile)
        self.patterns: List[Tuple[Tuple[int, int], ...]] = []
        self._marked: Set[int] = set()

    def __call__(self, batch: Any) -> Any:
        return self.mark(self.pad(batch))

    def bucket_for(self, length: int) -> Optional[int]:
        """The smallest bucket that holds ``length``; ``None`` when it is longer than every bucket."""
        pad = self.shapes.pad
        if self.buckets is None:
            return -(-length // pad.multiple_of) * pad.multiple_of
        return next((bucket for bucket in self.buckets if bucket >= length), None)

    def pad(self, batch: Any, length: Optional[int] = None) -> Any:
        """Pad the declared entries to the bucket of the longest (or to ``length``, cutting if need be)."""
        pad = self.shapes.pad
        if not pad.enabled:
            return batch
        entries = {path: get_entry(batch, path) for path in pad.values}
        dims = {path: _check_dim(path, t, pad.dim, batch) for path, t in entries.items()}
        longest = max(t.shape[dims[path]] for path, t in entries.items())
        self._check_undeclared(batch, entries, dims, longest)
        if length is None:
            length = self.bucket_for(longest)
            if length is None and pad.overflow == "error":
                raise ShapeError(
                    f"batch entries {', '.join(map(repr, entries))} have length {longest} at dim {pad.dim}, longer "
                    f"than the largest bucket {self.buckets[-1]} (shapes.pad.overflow: error); add a bucket, "
                    "or set overflow: truncate to cut such batches"
                )
            length = self.buckets[-1] if length is None else length
        padded = {}
        for path, tensor in entries.items():
            _check_value(path, tensor, pad.values[path])
            padded[path] = pad_to_length(tensor, dims[path], length, pad.values[path])
        return replace_entries(batch, padded)

    def _check_undeclared(
        self, batch: Any, entries: Dict[str, torch.Tensor], dims: Dict[str, int], length: int
    ) -> None:
        """An entry shaped like the padded ones but without a pad value would fall out of step with them."""
        reference = next(iter(entries.values()))
        leading = tuple(reference.shape[: dims[next(iter(entries))]])
        for path, tensor in batch_tensors(batch):
            if path in entries or tensor.dim() <= len(leading):
                continue
            if tuple(tensor.shape[: len(leading)]) == leading and tensor.shape[len(leading)] == length:
                raise ShapeError(
                    f"batch entry {path!r} {tuple(tensor.shape)} has the padded length {length} at dim "
                    f"{len(leading)} but no pad value; add it to shapes.pad.values (pad_token_id for ids, "
                    "0/false for masks, ignore_index for labels)"
                )

    def mark(self, batch: Any) -> Any:
        """``mark_dynamic`` the declared dimensions of ``batch``'s entries (in place); returns ``batch``."""
        if not self.shapes.dynamic:
            return batch
        by_entry: Dict[str, List[Tuple[int, int]]] = {}
        self._marked = set()
        for spec in self.shapes.dynamic:
            tensor = get_entry(batch, spec.entry)
            dim = _check_dim(spec.entry, tensor, spec.dim, batch)
            size = tensor.shape[dim]
            if size < 2:
                continue  # 0/1 are specialized by Dynamo; marking would not make them dynamic
            if (spec.min is not None and size < spec.min) or (spec.max is not None and size > spec.max):
                raise ShapeError(
                    f"batch entry {spec.entry!r} has size {size} at dim {spec.dim}, outside the range "
                    f"[{spec.min}, {spec.max}] declared in shapes.dynamic; widen min/max, or pad/cut the batch"
                )
            torch._dynamo.mark_dynamic(tensor, dim, min=spec.min, max=spec.max)
            self._marked.add(id(tensor))
            by_entry.setdefault(spec.entry, []).append((dim, size))
        self.patterns = sorted({tuple(sorted(pattern)) for pattern in by_entry.values()})
        return batch

    def mark_region_inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Mark the tensor arguments of a compiled region that have a batch entry's dynamic sizes at the same dims.

        ``maybe_mark_dynamic`` is used, so a dimension the region's code needs static is specialized
        without an error.
        """
        if not self.patterns:
            return
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.Tensor) or id(value) in self._marked:
                continue
            for pattern in self.patterns:
                if all(dim < value.dim() and value.shape[dim] == size for dim, size in pattern):
                    torch._dynamo.maybe_mark_dynamic(value, [dim for dim, _ in pattern])

    def warmup_batches(self, batch: Any) -> List[Any]:
        """Batches made from ``batch`` that together compile every bucket (just ``batch`` without buckets)."""
        if self.buckets is None:
            return [self(batch)]
        return [self.mark(self.pad(batch, length)) for length in self.buckets]


class PadCollate:
    """A DataLoader ``collate_fn`` that pads each collated batch to its bucket on the host.

    Picklable (a class, not a closure), so it works with worker processes.
    """

    def __init__(self, shapes: ShapesPolicy, collate_fn: Optional[Callable[[List[Any]], Any]] = None):
        if not shapes.pad.enabled:
            raise ValueError("PadCollate needs a shapes policy whose `pad` section gives buckets")
        self.shaper = BatchShaper(shapes)
        self.collate_fn = collate_fn or default_collate

    def __call__(self, samples: List[Any]) -> Any:
        return self.shaper.pad(self.collate_fn(samples))


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
        parts.append(f"pad {', '.join(shapes.pad.values)} at dim {shapes.pad.dim} to buckets {lengths}")
    if shapes.warmup:
        parts.append("warm-up before the first step")
    if shapes.strict_recompiles:
        parts.append("recompiles after warm-up are errors")
    return "shapes: " + "; ".join(parts)
