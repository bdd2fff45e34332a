"""``shapes.warmup``: every bucket compiled from the regions' own calls, without running user code again.

A region call that compiles something (the first batch of a bucket, of a mode, of a new path through the
model) is recorded: a shadow of the region and copies of its inputs, with the grad mode and autocast state
it ran under (``compile_trainer.compiling.background.RecordedCall``). At the next batch, each recorded call
is replayed once for every other bucket: its inputs resized along the dims that carried the batch's length
(values zero: tracing reads only metadata), compiled forward and backward without running
(``compile_only``). Nothing runs the user's ``training_step``, hooks or metrics, no random number is drawn,
no weight or buffer of the model changes.

What it cannot see: a path that the model's eager code takes only for some batches (Hugging Face drops an
all-ones attention mask, so a batch exactly as long as its bucket passes no mask to the blocks) compiles at
its first batch, a recompile in the summary; that call is then replayed for the other buckets. A region with
graph breaks gets its first graph compiled here, the rest at their first batch. Where the length dims are
guessed wrong (``length_dims``), the trace fails: logged, not counted, and that bucket compiles at its batch.
"""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map_only

from compile_trainer import compat
from compile_trainer.compiling.background import RecordedCall
from compile_trainer.compiling.region_call import BUCKET_WARMUP
from compile_trainer.compiling.regions import AppliedPolicy, CompiledRegion

log = logging.getLogger(__name__)


def is_mask(tensor: torch.Tensor) -> bool:
    """Booleans, 0/1 integers, or floats of 0 and the most negative values: an attention mask."""
    if tensor.dtype == torch.bool:
        return True
    if tensor.is_floating_point():
        low = torch.finfo(tensor.dtype).min
        return bool(((tensor == 0) | (tensor <= low) | tensor.isneginf()).all())
    return bool(((tensor == 0) | (tensor == 1)).all())


def length_dims(tensor: torch.Tensor, length: int, batch_size: int, batch_dim: int = 1) -> List[int]:
    """The dims of a region input that carry the batch's ``length``: those of its size (not a leading dim that is
    the batch size). Where several have it, a mask's are all lengths (``(B, 1, T, T)``); anything else carries
    the length where the batch does (``batch_dim``, the padded dim: hidden states ``(B, T, H)`` where ``H == T``,
    a rotary table, channels-first ``(B, C, T)``), else at its first such dim."""
    dims = [d for d, size in enumerate(tensor.shape) if size == length and not (d == 0 and size == batch_size)]
    if len(dims) > 1 and not is_mask(tensor):
        dims = [batch_dim] if batch_dim in dims else dims[:1]
    return dims


def resized(tensor: torch.Tensor, dims: List[int], length: int) -> torch.Tensor:
    """A zero tensor like ``tensor`` with ``dims`` of size ``length``, strides in the same order of dims."""
    shape = [length if d in dims else s for d, s in enumerate(tensor.shape)]
    order = sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), -d), reverse=True)
    strides, step = [0] * tensor.dim(), 1
    for d in reversed(order):  # dense, innermost (smallest stride) first
        strides[d], step = step, step * shape[d]
    made = torch.empty_strided(shape, strides, dtype=tensor.dtype, device=tensor.device).zero_()
    return compat.copy_dynamo_marks(tensor, made.requires_grad_(tensor.requires_grad))


@contextlib.contextmanager
def unchanged_random_state() -> Iterator[None]:
    """Tracing draws Python's random numbers for real (Dynamo replays them in the graph) and ``compile_only``
    skips the compilers' own restores: put back what training would have drawn next."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)


class BucketWarmup:
    """Records the region calls that compile, and replays them for every other bucket (``replay``)."""

    position = BUCKET_WARMUP
    replaces_compiled = False

    def __init__(self, applied: AppliedPolicy, buckets: Callable[[], List[int]], batch_dim: int):
        self.applied = applied
        self.buckets = buckets  # the bucket lengths, once known (auto buckets: after the first batches)
        self.batch_dim = batch_dim  # the dim the batch's entries are padded at
        self.length: Optional[int] = None  # the padded length of the batch in use
        self.batch_size: Optional[int] = None
        self.pending: List[Tuple[CompiledRegion, RecordedCall, int, int]] = []  # (item, call, length, batch size)
        applied.interceptors.add(self)

    def __call__(self, item: CompiledRegion, proceed: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        if self.length is None:
            return proceed(*args, **kwargs)
        before = compat.unique_graphs()
        output = proceed(*args, **kwargs)
        if compat.unique_graphs() > before:  # recorded after the call: calls that compile nothing cost nothing
            recorded = RecordedCall.record(item.region.module, args, kwargs)
            self.pending.append((item, recorded, self.length, self.batch_size))
        return output

    def replay(self) -> int:
        """Compile each pending call at the buckets it did not run at; how many graphs that compiled."""
        pending, self.pending = self.pending, []
        count = 0
        # backward graphs compiled with the forward (torch >= 2.11); before, at the bucket's first backward
        lowering = compat.eager_backward_lowering() if not compat.eager_backward_lowering_problem() else None
        with unchanged_random_state(), lowering or contextlib.nullcontext():
            for item, call, length, batch_size in pending:
                for bucket in self.buckets():
                    if bucket != length:
                        count += self._replay_at(item, call, length, batch_size, bucket)
        return count

    def _replay_at(self, item: CompiledRegion, call: RecordedCall, length: int, batch_size: int, bucket: int) -> int:
        def at_bucket(tensor: torch.Tensor) -> torch.Tensor:
            dims = length_dims(tensor, length, batch_size, self.batch_dim)
            return resized(tensor, dims, bucket) if dims else tensor

        args = tree_map_only(torch.Tensor, at_bucket, call.args)
        kwargs = tree_map_only(torch.Tensor, at_bucket, call.kwargs)
        before = compat.unique_graphs()
        try:
            call.replay(item, args, kwargs)
        except Exception as error:  # noqa: BLE001 - the bucket then compiles at its first batch, as without warm-up
            cause = compat.traced_error_summary(error)
            log.warning(
                "compile warm-up of %s at length %d failed (%s); it compiles at its first batch of that length",
                item.region.name,
                bucket,
                cause,
            )
            return 0
        return compat.unique_graphs() - before

    def remove(self) -> None:
        self.applied.interceptors.remove(self)
