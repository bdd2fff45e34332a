"""The compiled update of each supported torch optimizer family, over flat segments (see docs/optimizer.md).

A segment is one contiguous buffer per role (param, grad, each state tensor) holding every parameter of one
param group, device and dtype (``compile_trainer.optimizer.flat``). The update is a chain of pointwise ops over
each segment, which Inductor fuses into one kernel per segment that reads param, grad and state once and writes
them once (7 passes for AdamW). Clipping by norm reads per-parameter norms that the gradient hooks took as
gradients landed (``flat.py``), so it adds no pass over the gradients to the step.

Each op is rounded as torch's single-tensor (for-loop) implementation rounds it on the same device: its kernels
fuse multiply-adds (``lerp``, ``addcmul``, ``add`` with ``alpha``) and divide exactly, so the update does too
(``_fma``, ``_divide``). Eager CPU kernels take square roots through a vector library that is not always
correctly rounded; Inductor's are, which leaves about 1e-7 (relative) between the two after 100 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from compile_trainer.schema import PolicyError

Segment = List[Tensor]  # [param, grad, *state buffers] (Adam's step counts last)
Clipping = Tuple[Optional[float], Optional[float]]  # (max norm, max absolute value); None: not clipped
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def _clipped_grads(
    segments: Sequence[Segment], clip: Clipping, grad_norm: Optional[Tensor], grad_norms: Optional[List[Tensor]]
) -> List[Tensor]:
    """The gradients to apply, clipped as ``clip_grad_norm_`` / ``clip_grad_value_`` would (the flat gradients
    themselves are left as they are). Clipping by norm takes the total norm from each segment's per-parameter
    norms (``grad_norms``: taken by the gradient hooks, or just before this step), as ``clip_grad_norm_`` takes it
    from per-tensor norms, and writes it into ``grad_norm`` (no host sync)."""
    clip_norm, clip_value = clip
    grads = [segment[1] for segment in segments]
    if clip_norm is not None:
        norm = torch.linalg.vector_norm(torch.cat(grad_norms))
        grad_norm.copy_(norm)
        coefficient = torch.clamp(clip_norm / (norm + CLIP_EPS), max=1.0)
        grads = [grad * coefficient.to(grad.dtype) for grad in grads]
    if clip_value is not None:
        grads = [grad.clamp(-clip_value, clip_value) for grad in grads]
    return grads


def update_segments(
    segments: List[Segment],
    hyper: Tensor,
    rows: Tuple[int, ...],
    flags: Tuple[Tuple[bool, ...], ...],
    clip: Clipping,
    grad_norm: Optional[Tensor],
    grad_norms: Optional[List[Tensor]],
    update_segment: Callable[[Segment, Tensor, Tensor, Tuple[bool, ...]], None],
) -> None:
    """The compiled function: clip the gradients, then ``update_segment`` for each segment with its group's
    hyperparameters (``hyper[row]``, float64) and flags."""
    grads = _clipped_grads(segments, clip, grad_norm, grad_norms)
    for segment, grad, row in zip(segments, grads, rows):
        update_segment(segment, grad, hyper[row], flags[row])


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once, as torch's eager kernels compute a multiply-add (their compilers fuse it).

    Inductor lowers ``addcmul`` (value 1) to a fused multiply-add on GPUs; its C++ code for the CPU is built with
    ``-ffp-contract=off``, so there the product of two floats is taken in float64 (exact) and rounded once."""
    if c.device.type == "cpu":
        return torch.addcmul(c.double(), a.double(), b.double()).to(c.dtype)
    return torch.addcmul(c, a, b)


def _divide(a: Tensor, b: Tensor) -> Tensor:
    """``a / b`` correctly rounded, as eager: Inductor's ``addcdiv`` keeps the division exact on GPUs, where a plain
    ``/`` becomes Triton's approximate division."""
    return torch.addcdiv(torch.zeros((), dtype=a.dtype, device=a.device), a, b)


def _lerp(start: Tensor, end: Tensor, weight: Tensor) -> Tensor:
    """``start.lerp(end, weight)`` rounded as torch's kernel: one multiply-add from ``start``, or from ``end`` for
    weights of magnitude 0.5 and more."""
    far = weight.abs() >= 0.5
    return _fma(torch.where(far, weight - 1, weight), end - start, torch.where(far, end, start))


def _add_squared(base: Tensor, grad: Tensor, weight: Tensor) -> Tensor:
    """``base.addcmul(grad, grad, value=weight)`` rounded as torch's kernel on this device: the CPU kernel fuses
    ``(weight * grad) * grad + base``, the CUDA kernel ``weight * (grad * grad) + base``."""
    if grad.device.type == "cpu":
        return _fma(weight * grad, grad, base)
    return _fma(weight, grad * grad, base)


def _add_ratio(base: Tensor, weight: Tensor, numerator: Tensor, denominator: Tensor) -> Tensor:
    """``base.addcdiv(numerator, denominator, value=weight)`` rounded as torch's kernel on this device: the CPU
    kernel computes ``base + (weight * numerator) / denominator``, the CUDA kernel a multiply-add of the quotient."""
    if base.device.type == "cpu":
        return base + weight * numerator / denominator
    return _fma(weight, _divide(numerator, denominator), base)


def _adam_segment(segment: Segment, grad: Tensor, hyper: Tensor, flags: Tuple[bool, ...]) -> None:
    """Adam/AdamW as torch's single-tensor implementation, op for op and rounded as its kernels round."""
    amsgrad, maximize, decoupled = flags
    param, exp_avg, exp_avg_sq, steps = segment[0], segment[2], segment[3], segment[-1]
    lr, beta1, beta2, eps, weight_decay = hyper.unbind()
    steps.add_(1)  # every parameter of a segment has the same count (flat.py checks)
    step = steps[0].to(hyper.dtype)
    # Scalars in float64 (as torch's Python floats), then float32 for the elementwise work (as its kernels).
    neg_step_size, bias_correction2_sqrt, decay, weight_decay, avg_weight, beta2, sq_weight, eps = torch.stack(
        [-lr / (1 - beta1**step), (1 - beta2**step).sqrt(), 1 - lr * weight_decay, weight_decay, 1 - beta1]
        + [beta2, 1 - beta2, eps]
    ).float()
    if maximize:
        grad = -grad
    if decoupled:
        param.mul_(decay)
    else:
        grad = _fma(weight_decay, param, grad)
    exp_avg.copy_(_lerp(exp_avg, grad, avg_weight))
    exp_avg_sq.copy_(_add_squared(exp_avg_sq * beta2, grad, sq_weight))
    if amsgrad:
        segment[4].copy_(torch.maximum(segment[4], exp_avg_sq))
        exp_avg_sq = segment[4]
    denom = _divide(exp_avg_sq.sqrt(), bias_correction2_sqrt) + eps
    param.copy_(_add_ratio(param, neg_step_size, exp_avg, denom))


def _sgd_segment(segment: Segment, grad: Tensor, hyper: Tensor, flags: Tuple[bool, ...]) -> None:
    """SGD (with momentum, dampening, Nesterov), as torch's single-tensor implementation (its ``add`` with
    ``alpha`` is a multiply-add)."""
    has_momentum, nesterov, maximize = flags
    param = segment[0]
    lr, momentum, dampening, weight_decay = hyper.unbind()
    neg_lr, momentum, grad_weight, weight_decay = torch.stack([-lr, momentum, 1 - dampening, weight_decay]).float()
    if maximize:
        grad = -grad
    grad = _fma(weight_decay, param, grad)
    if has_momentum:
        buf = segment[2]
        buf.copy_(_fma(grad_weight, grad, buf * momentum))
        grad = _fma(momentum, buf, grad) if nesterov else buf
    param.copy_(_fma(neg_lr, grad, param))


@dataclass(frozen=True)
class _Algorithm:
    """How one family of torch optimizers maps onto a compiled update."""

    update_segment: Callable[[Segment, Tensor, Tensor, Tuple[bool, ...]], None]
    hyper: Callable[[Dict[str, Any]], List[float]]
    flags: Callable[[torch.optim.Optimizer, Dict[str, Any]], Tuple[bool, ...]]
    # The per-parameter state tensors that live in flat buffers, in the update's order, for a group's flags.
    state_keys: Callable[[Tuple[bool, ...]], Tuple[str, ...]]
    has_step: bool  # Adam's per-parameter step counts, kept as one vector per segment


ADAM = _Algorithm(
    update_segment=_adam_segment,
    hyper=lambda g: [float(v) for v in (g["lr"], *g["betas"], g["eps"], g["weight_decay"])],
    flags=lambda opt, g: (
        bool(g.get("amsgrad")),
        bool(g.get("maximize")),
        bool(g.get("decoupled_weight_decay")) or isinstance(opt, torch.optim.AdamW),
    ),
    state_keys=lambda flags: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if flags[0] else ("exp_avg", "exp_avg_sq"),
    has_step=True,
)
SGD = _Algorithm(
    update_segment=_sgd_segment,
    hyper=lambda g: [float(g[k]) for k in ("lr", "momentum", "dampening", "weight_decay")],
    flags=lambda opt, g: (g["momentum"] != 0, bool(g.get("nesterov")), bool(g.get("maximize"))),
    state_keys=lambda flags: ("momentum_buffer",) if flags[0] else (),
    has_step=False,
)
SUPPORTED: Dict[type, _Algorithm] = {torch.optim.Adam: ADAM, torch.optim.AdamW: ADAM, torch.optim.SGD: SGD}


def supported_names() -> str:
    return ", ".join(cls.__name__ for cls in SUPPORTED) + " (torch.optim; SGD with or without momentum)"


def algorithm_for(optimizer: torch.optim.Optimizer) -> _Algorithm:
    """The compiled update for ``optimizer``; a ``PolicyError`` naming what is supported otherwise."""
    name = type(optimizer).__name__
    algorithm = SUPPORTED.get(type(optimizer))
    if algorithm is None:
        raise PolicyError(
            f"optimizer.compile cannot compile {type(optimizer).__module__}.{name}: supported optimizers are "
            f"{supported_names()}. Set compile.optimizer.compile=false to keep its own step."
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise PolicyError(f"optimizer.compile: {name} param group {index} has differentiable=True, not supported.")
        if any(torch.is_complex(p) for p in group["params"]):
            raise PolicyError(f"optimizer.compile: {name} param group {index} has complex parameters, not supported.")
        subclasses = {type(p.data).__name__ for p in group["params"] if type(p.data) is not torch.Tensor}
        if subclasses:
            raise PolicyError(
                f"optimizer.compile: {name} param group {index} has parameters of tensor subclasses "
                f"({', '.join(sorted(subclasses))}, e.g. DTensor under FSDP), which cannot become views of a flat "
                "buffer; set compile.optimizer.compile=false."
            )
    return algorithm
