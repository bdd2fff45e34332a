"""The optimizer's internals a replacement step needs: its step hooks, and the attributes LR schedulers and
GradScaler read."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from .entry import Entry

__all__ = [
    "ENTRIES",
    "LR_SCHEDULER_WRAPPED",
    "fused_unsupported_reason",
    "mark_optimizer_stepped",
    "optimizer_step_hooks",
    "set_step_handles_amp_scaling",
]

# Optimizer.step runs the global and per-optimizer step hooks; a replacement step must run them too, set
# `_opt_called` (LR schedulers warn without it) and say whether it handles AMP scaling.
LR_SCHEDULER_WRAPPED = "_wrapped_by_lr_sched"  # LRScheduler does not wrap a step that has this attribute


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple:
    """(pre hooks, post hooks) that ``Optimizer.step`` would run, in its order."""
    from torch.optim import optimizer as optim_module

    pre = [*optim_module._global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()]
    post = [*optimizer._optimizer_step_post_hooks.values(), *optim_module._global_optimizer_post_hooks.values()]
    return pre, post


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    optimizer._opt_called = True


def set_step_handles_amp_scaling(optimizer: torch.optim.Optimizer, handles: bool) -> None:
    """A GradScaler unscales and skips inf steps itself unless the step says it does (as fused steps do)."""
    optimizer._step_supports_amp_scaling = handles


def fused_unsupported_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why torch's fused kernel cannot run this optimizer's parameters, or None if it can."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                _device_dtype_check_for_fused(param)
    except RuntimeError as error:
        return str(error)
    return None


# -- The probes --------------------------------------------------------------------------------------------


def _probe_optimizer() -> None:
    """The hooks a replacement step runs, and the attributes LR schedulers and GradScaler read."""
    import inspect

    from torch.amp import grad_scaler
    from torch.optim import lr_scheduler
    from torch.optim import optimizer as optim_module

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    hooks = [
        optimizer.register_step_pre_hook(lambda *args: None),
        optimizer.register_step_post_hook(lambda *args: None),
        optim_module.register_optimizer_step_pre_hook(lambda *args: None),
        optim_module.register_optimizer_step_post_hook(lambda *args: None),
    ]
    try:
        pre, post = optimizer_step_hooks(optimizer)
        assert len(pre) == len(post) == 2, (pre, post)
    finally:
        for handle in hooks:
            handle.remove()
    assert optimizer_step_hooks(optimizer) == ([], [])

    def step(closure: Any = None) -> None:
        mark_optimizer_stepped(optimizer)

    setattr(step, LR_SCHEDULER_WRAPPED, True)
    optimizer.step = step
    scheduler = lr_scheduler.StepLR(optimizer, step_size=1)
    assert optimizer.step is step, "LRScheduler wrapped a step marked as wrapped"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of lr_scheduler.step() before optimizer.step()"
        optimizer.step()
        scheduler.step()
    set_step_handles_amp_scaling(optimizer, False)
    assert '"_step_supports_amp_scaling"' in inspect.getsource(grad_scaler)
    assert fused_unsupported_reason(optimizer) is None
    half = torch.optim.SGD([nn.Parameter(torch.zeros(1, dtype=torch.float64))], lr=0.1)
    assert fused_unsupported_reason(half) is None or isinstance(fused_unsupported_reason(half), str)


ENTRIES = [
    Entry(
        "optimizer internals",
        _probe_optimizer,
        reaches=(
            "torch.optim.optimizer._global_optimizer_pre_hooks",
            "torch.optim.optimizer._global_optimizer_post_hooks",
            "torch.optim.optimizer._device_dtype_check_for_fused",
            "torch.optim.lr_scheduler.LRScheduler",
            "torch.amp.grad_scaler",
        ),
        checked=("2.9.1", "2.13"),
    ),
]
