"""Applying a policy's ``shapes`` section to batches: padding to buckets and ``mark_dynamic``.

``BatchShaper`` applies both to a batch (a tensor, or dicts, lists, tuples, named tuples and dataclasses of
them); it works without Lightning, and ``PadCollate`` does the padding in a DataLoader on the host.
Entries are named by dotted paths: dict keys, sequence indices, or field names (``inputs``, ``0``,
``features.mask``). The declarations and their checks: ``compile_trainer.schema.shapes``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path
from torch.utils.data import default_collate

from compile_trainer import compat
from compile_trainer.schema.shapes import ROLE_NAMES, ShapesPolicy, bucket_lengths, role_of
from compile_trainer.shapes.buckets import LengthSample, choose_buckets, padding_overhead

log = logging.getLogger(__name__)


class ShapeError(ValueError):
    """A batch that does not fit the policy's ``shapes`` section."""


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


def _rows(entries: Dict[str, torch.Tensor], dims: Dict[str, int]) -> int:
    """Rows (sequences) of a batch padded along ``dims``: the product of the first entry's leading sizes."""
    path, tensor = next(iter(entries.items()))
    return int(torch.Size(tensor.shape[: dims[path]]).numel())


class BatchShaper:
    """Applies a ``ShapesPolicy`` to batches: ``shaper(batch)`` pads, then marks; both also work alone.

    Padding returns a new batch of the same container types; marking marks the tensors in place. The
    shaper remembers the dynamic sizes of the last batch it marked, for ``mark_region_inputs``. Entries named
    by role (``@tokens``, ``@labels``) are resolved against the first batch (``resolve``); ``shapes`` then names
    the batch's own entries, and ``declared`` keeps the policy's section as it was given.
    """

    def __init__(self, shapes: ShapesPolicy):
        self.declared = self.shapes = shapes
        self.resolved: Optional[Dict[str, str]] = None  # role -> the batch's entry, once resolved
        self.buckets = bucket_lengths(shapes.pad) if shapes.pad.enabled else None
        self.expected_padding_overhead: Optional[float] = None  # of buckets chosen from the data
        self.real_positions = self.padded_positions = 0  # along the padded dim, over the batches padded
        # (dim, size) of the last marked batch's dynamic dimensions, and the ids of its marked tensors
        # (alive while that batch is in use, so an id cannot be another tensor's meanwhile)
        self.dynamic_sizes: Set[Tuple[int, int]] = set()
        self._marked: Set[int] = set()
        self._region_dims: Dict[Tuple[str, str], List[int]] = {}  # (region, input path) -> dims it marks

    def __call__(self, batch: Any) -> Any:
        return self.mark(self.pad(batch))

    def resolve(self, batch: Any) -> None:
        """Name the batch's own entries where the policy names roles (once: the first batch decides)."""
        if self.resolved is not None:
            return
        declared = self.declared
        entries = [spec.entry for spec in declared.dynamic] + list(declared.pad.values)
        names = {path for path, _ in batch_tensors(batch)}
        found = {e: next((n for n in ROLE_NAMES[role_of(e)] if n in names), None) for e in entries if role_of(e)}
        if entries and all(found.get(e, e) is None for e in entries):
            raise ShapeError(
                f"none of the entries the compile policy's shapes section names ({', '.join(entries)}) is in the "
                f"batch; entries seen: {describe_batch(batch)}. Name them in shapes.dynamic / shapes.pad.values"
            )
        dynamic = [dataclasses.replace(d, entry=found.get(d.entry, d.entry)) for d in declared.dynamic]
        values = {e: v for e, v in declared.pad.values.items() if role_of(e) is None}
        for entry, value in declared.pad.values.items():  # an entry named directly wins over a role
            if found.get(entry) is not None:
                values.setdefault(found[entry], value)
        self.shapes = dataclasses.replace(
            declared,
            dynamic=[d for d in dynamic if d.entry is not None],
            pad=dataclasses.replace(declared.pad, values=values),
        )
        self.resolved = {role: name for role, name in found.items() if name is not None}
        if found:
            log.info("shapes: %s", ", ".join(f"{role} is {name or 'not in the batch'}" for role, name in found.items()))

    def length_of(self, batch: Any) -> LengthSample:
        """The batch's length along the padded dimension (its longest padded entry) and its rows."""
        self.resolve(batch)
        entries, dims, longest = self._padded_entries(batch)
        return LengthSample(longest, _rows(entries, dims))

    def choose_buckets(self, samples: List[LengthSample]) -> List[int]:
        """``shapes.pad.auto``: the buckets that pad ``samples`` (observed batch lengths) least."""
        auto, pad = self.shapes.pad.auto, self.shapes.pad
        if auto is None:
            raise ValueError("choose_buckets is for shapes.pad.auto; this policy gives its buckets")
        if pad.max is not None and max(s.length for s in samples) > pad.max:
            pad = dataclasses.replace(pad, max=None)  # batches already overflow: the buckets hold what was seen
        self.buckets = choose_buckets(samples, auto.count, auto.multiple_of, pad.max)
        self.expected_padding_overhead = padding_overhead(samples, self.buckets)
        return self.buckets

    def padding_summary(self) -> Dict[str, Any]:
        """Bucket lengths and the padding they cost: expected (from the observed lengths) and measured."""
        measured = self.padded_positions / self.real_positions - 1 if self.real_positions else None
        return {
            "buckets": list(self.buckets) if self.buckets is not None else None,
            "expected_padding_overhead": self.expected_padding_overhead,
            "padding_overhead": measured,
        }

    def _require_chosen_buckets(self) -> None:
        if self.buckets is None and self.shapes.pad.auto is not None:
            raise ShapeError(
                "shapes.pad.auto has not chosen its buckets yet: call BatchShaper.choose_buckets with observed "
                "batch lengths first (CompileCallback does, from the first training batches)"
            )

    def bucket_for(self, length: int) -> Optional[int]:
        """The smallest bucket that holds ``length``; ``None`` when it is longer than every bucket."""
        pad = self.shapes.pad
        self._require_chosen_buckets()
        if self.buckets is None:
            return -(-length // pad.multiple_of) * pad.multiple_of
        return next((bucket for bucket in self.buckets if bucket >= length), None)

    def pad(self, batch: Any, length: Optional[int] = None) -> Any:
        """Pad the declared entries to the bucket of the longest (or to ``length``, cutting if need be)."""
        self.resolve(batch)
        pad = self.shapes.pad
        if not pad.enabled:
            return batch
        entries, dims, longest = self._padded_entries(batch)
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
            rows = _rows(entries, dims)
            self.real_positions += rows * min(longest, length)
            self.padded_positions += rows * length
        padded = {}
        for path, tensor in entries.items():
            _check_value(path, tensor, pad.values[path])
            padded[path] = pad_to_length(tensor, dims[path], length, pad.values[path])
        return replace_entries(batch, padded)

    def _padded_entries(self, batch: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, int], int]:
        pad = self.shapes.pad
        entries = {path: get_entry(batch, path) for path in pad.values}
        dims = {path: _check_dim(path, t, pad.dim, batch) for path, t in entries.items()}
        return entries, dims, max(t.shape[dims[path]] for path, t in entries.items())

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
        self.resolve(batch)
        if not self.shapes.dynamic:
            return batch
        self._marked, self.dynamic_sizes = set(), set()
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
            compat.mark_dynamic(tensor, dim, min=spec.min, max=spec.max)
            self._marked.add(id(tensor))
            self.dynamic_sizes.add((dim, size))
        return batch

    def mark_region_inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], region: str = "") -> None:
        """Mark each tensor a compiled region gets (nested in tuples, lists and dicts too) dynamic at the dims
        that carry the batch's dynamic sizes: hidden states (B, T, H), position ids (1, T), rotary tables
        (1, T, D), a 4-D attention mask (B, 1, T, T), which the model derives from the batch inside other regions.

        Which dims, is decided at the region's first call and kept (per input, by its place in the call): a
        batch size (dim 0) marks dim 0 only; a length (a later dim) marks every dim of its size, since a model
        moves and repeats it. Kept, because Dynamo guards that a call marks no dim its graph was not compiled
        dynamic in: a later length equal to a hidden size must not mark that dim. A static size equal to the
        length at the first call (a head dim of 128 at length 128) gets the length's symbol and can pin it: one
        more compile. ``maybe_mark_dynamic``: a dim the region's code needs static is specialized, no error.
        """
        if not self.dynamic_sizes:
            return
        lengths = {size for dim, size in self.dynamic_sizes if dim > 0}
        leaves, _ = tree_flatten_with_path((args, kwargs))
        for path, value in leaves:
            if not isinstance(value, torch.Tensor) or id(value) in self._marked:
                continue
            key = (region, keystr(path))
            if key not in self._region_dims:
                shape = value.shape
                self._region_dims[key] = [
                    d for d in range(value.dim()) if (d, shape[d]) in self.dynamic_sizes or shape[d] in lengths
                ]
            dims = [d for d in self._region_dims[key] if d < value.dim() and value.shape[d] >= 2]
            if dims:
                compat.maybe_mark_dynamic(value, dims)


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
