"""The ``shapes`` section at run time: shaping Lightning's batches, warm-up, and the strict-recompile guard.

Lightning callbacks receive the batch but cannot replace it, and padding makes new tensors. So
``ShapeHooks`` wraps the strategy's ``batch_to_device`` (the step that moves a batch to the device and then
runs the module's or datamodule's ``on_after_batch_transfer``), on the strategy instance, for the length of
``fit``: what it returns is what ``training_step``/``validation_step`` get, padded and marked on the device.

``RegionHooks`` wraps each compiled region's call: it marks the region's inputs dynamic like the batch
(regional compilation sees activations, not the batch), and, once armed, runs the region under
``torch.compiler.set_stance("fail_on_recompile")`` and names the region in the error. The stance is set
only around region calls, so other compiled code (a compiled optimizer step, say) can still compile.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Set, Tuple

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from compile_trainer.apply import APPLIED_ATTR, AppliedPolicy, CompiledRegion
from compile_trainer.policy import PolicyError
from compile_trainer.shapes import BatchShaper, ShapesPolicy
from compile_trainer.telemetry import WARMUP_PHASE

log = logging.getLogger(__name__)

STANCE_MESSAGE = "fail_on_recompile"  # in the RuntimeError Dynamo raises under that stance


class RecompileError(RuntimeError):
    """A compiled region would recompile after warm-up while ``strict_recompiles`` is on."""


def _mode(root: nn.Module) -> Tuple[bool, bool]:
    """What a compiled graph depends on beyond its inputs: grad mode and train/eval mode."""
    return torch.is_grad_enabled(), root.training


def mode_name(mode: Tuple[bool, bool]) -> str:
    return "training" if mode[1] else "evaluation"


class RegionHooks:
    """Wraps every compiled region's call of an ``AppliedPolicy``; ``remove()`` unwraps them."""

    def __init__(self, applied: AppliedPolicy, shaper: BatchShaper):
        self.applied, self.shaper = applied, shaper
        self.armed: Set[Tuple[bool, bool]] = set()
        self._wrapped: List[Tuple[nn.Module, Callable[..., Any], Callable[..., Any]]] = []
        root = applied.root
        for item in applied.compiled:
            module = item.region.module
            inner = module._compiled_call_impl
            wrapper = self._wrap(item, inner, root)
            module._compiled_call_impl = wrapper
            self._wrapped.append((module, inner, wrapper))

    def arm(self, mode: Tuple[bool, bool]) -> None:
        """From now on a recompile in this mode is an error."""
        self.armed.add(mode)

    def _wrap(self, item: CompiledRegion, inner: Callable[..., Any], root: nn.Module) -> Callable[..., Any]:
        mark_inputs = self.shaper.shapes.mark_region_inputs and bool(self.shaper.shapes.dynamic)

        def call(*args: Any, **kwargs: Any) -> Any:
            if mark_inputs:
                self.shaper.mark_region_inputs(args, kwargs)
            mode = _mode(root)
            if mode not in self.armed:
                return inner(*args, **kwargs)
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return inner(*args, **kwargs)
            except RuntimeError as error:
                if STANCE_MESSAGE not in str(error):
                    raise
                raise RecompileError(self._describe(item, mode, error, (args, kwargs))) from error

        return call

    def _describe(self, item: CompiledRegion, mode: Tuple[bool, bool], error: RuntimeError, inputs: Any) -> str:
        sharing = [c.region.name for c in self.applied.compiled if c.entry_name == item.entry_name]
        shared = f" (its graph is shared by {', '.join(sharing)})" if len(sharing) > 1 else ""
        shapes = ", ".join(str(tuple(t.shape)) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
        return (
            f"strict_recompiles: compiled region {item.region.name!r} ({item.region.class_name}){shared} would "
            f"recompile in {mode_name(mode)} after warm-up, called with tensors of shape {shapes}. "
            f"Dynamo says: {error}\n"
            "Declare this shape in the compile policy (a bucket in shapes.pad, a dimension in shapes.dynamic), "
            "or turn shapes.strict_recompiles off."
        )

    def remove(self) -> None:
        for module, inner, wrapper in self._wrapped:
            if module._compiled_call_impl is wrapper:  # not if AppliedPolicy.remove() undid the compile since
                module._compiled_call_impl = inner
        self._wrapped = []


@contextlib.contextmanager
def preserved_training_state(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run steps that leave no trace: RNG streams, gradients and buffers are restored afterwards."""
    grads = [(p, p.grad) for p in module.parameters()]
    for parameter, _ in grads:
        parameter.grad = None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [] if device.type == "cpu" else [device.index if device.index is not None else 0]
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield
    finally:
        for parameter, grad in grads:
            parameter.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


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
        self.regions: Optional[RegionHooks] = None  # wrapped at the first batch, after the policy is applied
        self.warmed: Set[str] = set()
        self._strategy = trainer.strategy
        self._original = self._strategy.batch_to_device
        self._strategy.batch_to_device = self._batch_to_device

    def _batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = self._original(batch, device, dataloader_idx)
        if self.regions is None:
            self.regions = RegionHooks(self._applied_policy(), self.shaper)
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
        mode = (True, module.training) if stage == "train" else _mode(module)
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
