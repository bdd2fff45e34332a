"""The ``shapes`` section inside ``Trainer.fit``: shaping Lightning's batches and warming up every bucket.

Lightning callbacks receive the batch but cannot replace it, and padding makes new tensors. So
``ShapeHooks`` wraps the strategy's ``batch_to_device`` (the step that moves a batch to the device and then
runs the module's or datamodule's ``on_after_batch_transfer``), on the strategy instance, for the length of
``fit``: what it returns is what ``training_step``/``validation_step`` get, padded and marked on the device.

The region-call interceptors (marking region inputs, strict recompiles, recording the calls that compile for
the bucket warm-up) come from ``compile_trainer.shapes``; they are added to the policy's chain at the first
batch. Warm-up replays the recorded calls at the next batch, before it is shaped (``shapes.bucket_warmup``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

from compile_trainer.compiling.regions import APPLIED_ATTR, AppliedPolicy
from compile_trainer.schema import PolicyError, ShapesPolicy
from compile_trainer.shapes.batch import BatchShaper
from compile_trainer.shapes.bucket_warmup import BucketWarmup
from compile_trainer.shapes.buckets import LengthSample, padding_overhead
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors, step_mode
from compile_trainer.telemetry.compile_events import WARMUP_PHASE

log = logging.getLogger(__name__)


class ShapeHooks:
    """Applies a policy's ``shapes`` section inside ``Trainer.fit``; ``remove()`` undoes it."""

    def __init__(
        self,
        trainer: pl.Trainer,
        shapes: ShapesPolicy,
        phase: Callable[[str], ContextManager[None]] = lambda name: contextlib.nullcontext(),
        warm_up_buckets: bool = True,
    ):
        self.trainer, self.shapes = trainer, shapes
        self.phase = phase  # names what compiles during warm-up (telemetry: not recompiles)
        self.warm_up_buckets = warm_up_buckets  # False: shapes.warmup only arms strict_recompiles (FSDP2)
        self.shaper = BatchShaper(shapes)
        self.regions: Optional[RegionShapeInterceptors] = None  # at the first batch, after the policy is applied
        self.warmup: Optional[BucketWarmup] = None  # with shapes.warmup, from the first batch on
        self._mode: Optional[Tuple[bool, bool]] = None  # the mode of the batch in use
        self._strategy = trainer.strategy
        self._original = self._strategy.batch_to_device
        self._strategy.batch_to_device = self._batch_to_device

    def choose_auto_buckets(self) -> Optional[str]:
        """``shapes.pad.auto``: read the lengths of the first training batches (the random state restored after,
        so training sees the batches it would have) and choose the buckets; a line for the plan, or None."""
        auto = self.shapes.pad.auto
        if auto is None or self.shaper.buckets is not None:
            return None
        samples = self._first_lengths(auto.sample_batches)
        buckets = self.shaper.choose_buckets(samples)
        longest = max(s.length for s in samples)
        to_longest = padding_overhead(samples, [longest])
        return (
            f"shapes: buckets {buckets} chosen from {len(samples)} training batches' lengths "
            f"({min(s.length for s in samples)}..{longest}): expected padding "
            f"{self.shaper.expected_padding_overhead:.1%} of the real positions (one bucket at the longest: "
            f"{to_longest:.1%})"
        )

    def _first_lengths(self, count: int) -> List[LengthSample]:
        self.trainer.fit_loop.setup_data()  # what fit does first anyway; idempotent
        loaders = [dl for dl in tree_leaves(self.trainer.train_dataloader) if isinstance(dl, DataLoader)]
        if not loaders:
            raise PolicyError("shapes.pad.auto reads the training batches' lengths, but fit has no DataLoader")
        samples: List[LengthSample] = []
        with isolate_rng():
            for batch in loaders[0]:
                samples.append(self.shaper.length_of(batch))
                if len(samples) == count:
                    break
        if not samples:
            raise PolicyError("shapes.pad.auto: the training DataLoader gave no batch to read lengths from")
        return samples

    def _batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = self._original(batch, device, dataloader_idx)
        if self.regions is None:
            applied = self._applied_policy()
            self.regions = RegionShapeInterceptors(applied, self.shaper)
            if self.shapes.warmup and self.warm_up_buckets and self.shapes.pad.enabled:
                self.warmup = BucketWarmup(applied, lambda: self.shaper.buckets or [], self.shapes.pad.dim)
        if self.shapes.warmup:
            self._warm_up()
        shaped = self.shaper(batch)
        if self.shapes.warmup:
            if self.warmup is not None:
                sample = self.shaper.length_of(shaped)
                self.warmup.length, self.warmup.batch_size = sample.length, sample.rows
            self._mode = step_mode(self.trainer.lightning_module)
        return shaped

    def _warm_up(self) -> None:
        """Compile the calls of the last batch that compiled, at every other bucket; then, with
        ``strict_recompiles``, a recompile in that batch's mode is an error."""
        if self.warmup is not None and self.warmup.pending:
            started = time.perf_counter()
            with self.phase(f"{WARMUP_PHASE} (buckets)"):
                graphs = self.warmup.replay()
            seconds = time.perf_counter() - started
            log.info("compile warm-up: %d graphs compiled at other buckets in %.1f s", graphs, seconds)
        if self._mode is not None and self.shapes.strict_recompiles:
            self.regions.arm(self._mode)  # idempotent: arming a mode again changes nothing

    def _applied_policy(self) -> AppliedPolicy:
        applied = getattr(self.trainer.lightning_module, APPLIED_ATTR, None)
        if applied is None:
            raise PolicyError("the compile policy's shapes section needs the policy applied first (CompileCallback)")
        return applied

    def remove(self) -> None:
        if self._strategy.__dict__.get("batch_to_device") == self._batch_to_device:
            del self._strategy.batch_to_device
        if self.regions is not None:
            self.regions.remove()
            self.regions = None
        if self.warmup is not None:
            self.warmup.remove()
            self.warmup = None
