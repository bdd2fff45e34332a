"""The ``shapes`` section inside ``Trainer.fit``: shaping Lightning's batches and warming up every bucket.

Lightning callbacks receive the batch but cannot replace it, and padding makes new tensors. So
``ShapeHooks`` wraps the strategy's ``batch_to_device`` (the step that moves a batch to the device and then
runs the module's or datamodule's ``on_after_batch_transfer``), on the strategy instance, for the length of
``fit``: what it returns is what ``training_step``/``validation_step`` get, padded and marked on the device.

The region-call interceptors (marking region inputs, strict recompiles) come from
``compile_trainer.shapes.region_inputs``; they are added to the policy's chain at the first batch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Set

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

from compile_trainer.compiling.regions import APPLIED_ATTR, AppliedPolicy
from compile_trainer.schema import PolicyError, ShapesPolicy
from compile_trainer.shapes.batch import BatchShaper
from compile_trainer.shapes.buckets import LengthSample, padding_overhead
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors, step_mode
from compile_trainer.telemetry.compile_events import WARMUP_PHASE
from compile_trainer.telemetry.throughput import preserved_training_state

log = logging.getLogger(__name__)


@contextlib.contextmanager
def logging_disabled(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` in a warm-up step would be logged (or refused outside a step hook): drop it."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict


def _step_kwargs(step: Callable[..., Any], dataloader_idx: int) -> Dict[str, Any]:
    """Lightning passes ``dataloader_idx`` only to steps that take it."""
    return {"dataloader_idx": dataloader_idx} if "dataloader_idx" in inspect.signature(step).parameters else {}


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) and loss.requires_grad else None


class ShapeHooks:
    """Applies a policy's ``shapes`` section inside ``Trainer.fit``; ``remove()`` undoes it."""

    def __init__(
        self,
        trainer: pl.Trainer,
        shapes: ShapesPolicy,
        phase: Callable[[str], ContextManager[None]] = lambda name: contextlib.nullcontext(),
    ):
        if shapes.warmup and not trainer.lightning_module.automatic_optimization:
            raise PolicyError(
                "shapes.warmup runs training_step and backward for each bucket, which needs automatic "
                "optimization; this module optimizes manually. Set shapes.warmup: false."
            )
        self.trainer, self.shapes = trainer, shapes
        self.phase = phase  # names what compiles during warm-up (telemetry: not recompiles)
        self.shaper = BatchShaper(shapes)
        self.regions: Optional[RegionShapeInterceptors] = None  # at the first batch, after the policy is applied
        self.warmed: Set[str] = set()
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
            self.regions = RegionShapeInterceptors(self._applied_policy(), self.shaper)
        stage = "train" if self.trainer.training else "eval"
        if self.shapes.warmup and stage not in self.warmed:
            self._warm_up(stage, batch, dataloader_idx)
        return self.shaper(batch)

    def _warm_up(self, stage: str, batch: Any, dataloader_idx: int) -> None:
        module = self.trainer.lightning_module
        strategy = self.trainer.strategy
        batches = self.shaper.warmup_batches(batch)
        started = time.perf_counter()
        with (
            self.phase(f"{WARMUP_PHASE} ({stage})"),
            preserved_training_state(module, module.device),
            logging_disabled(module),
        ):
            for warm_batch in batches:
                if stage == "train":
                    with torch.enable_grad():
                        loss = _loss_of(strategy.training_step(warm_batch, 0))
                        if loss is not None:
                            loss.backward()
                else:
                    kwargs = _step_kwargs(module.validation_step, dataloader_idx)
                    strategy.validation_step(warm_batch, 0, **kwargs)
        mode = (True, module.training) if stage == "train" else step_mode(module)
        self.warmed.add(stage)
        log.info("compile warm-up (%s): %d batch shapes in %.1f s", stage, len(batches), time.perf_counter() - started)
        if self.shapes.strict_recompiles:
            self.regions.arm(mode)

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
