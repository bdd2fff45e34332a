"""The compiled update of each supported torch optimizer family, written per parameter (see docs/optimizer.md).

The update is written per parameter, not with ``_foreach`` ops: Inductor then fuses each parameter's whole
update into one kernel that reads param, grad and state once and writes them once (7 tensor passes for
AdamW), autotuned like any pointwise kernel (Inductor's foreach kernels are not), and kernels with the same
source are compiled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from compile_trainer.schema import PolicyError

TensorLists = List[List[Tensor]]


def _adam_update(groups: List[TensorLists], hyper: Tensor, flags: Tuple[Tuple[bool, bool, bool], ...]) -> None:
    """Adam/AdamW for every parameter, in the order of torch's single-tensor implementation."""
    for (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps), row, (amsgrad, maximize, decoupled) in zip(
        groups, hyper, flags
    ):
        if not params:
            continue
        lr, beta1, beta2, eps, weight_decay = row.unbind()
        # Scalars once per group, not per parameter: a smaller graph compiles faster.
        torch._foreach_add_(steps, 1)
        step_counts = torch.stack(steps).to(hyper.dtype)
        step_sizes = lr / (1 - beta1**step_counts)
        bias_correction2_sqrts = (1 - beta2**step_counts).sqrt()
        decay, avg_weight, sq_weight = 1 - lr * weight_decay, 1 - beta1, 1 - beta2
        for i, param in enumerate(params):
            grad = -grads[i] if maximize else grads[i]
            if decoupled:
                param.mul_(decay)
            else:
                grad = grad + weight_decay * param
            exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
            exp_avg.lerp_(grad, avg_weight)
            exp_avg_sq.mul_(beta2).add_(sq_weight * grad * grad)
            if amsgrad:
                max_exp_avg_sqs[i].copy_(torch.maximum(max_exp_avg_sqs[i], exp_avg_sq))
                exp_avg_sq = max_exp_avg_sqs[i]
            denom = exp_avg_sq.sqrt() / bias_correction2_sqrts[i] + eps
            param.sub_(exp_avg / denom * step_sizes[i])


def _sgd_update(groups: List[TensorLists], hyper: Tensor, flags: Tuple[Tuple[bool, bool, bool], ...]) -> None:
    """SGD (with momentum, dampening, Nesterov) for every parameter, as torch's single-tensor implementation."""
    for (params, grads, momentum_buffers), row, (has_momentum, nesterov, maximize) in zip(groups, hyper, flags):
        lr, momentum, dampening, weight_decay = row.unbind()
        grad_weight = 1 - dampening
        for i, param in enumerate(params):
            grad = -grads[i] if maximize else grads[i]
            grad = grad + weight_decay * param
            if has_momentum:
                buf = momentum_buffers[i]
                buf.mul_(momentum).add_(grad_weight * grad)
                grad = grad + momentum * buf if nesterov else buf
            param.sub_(lr * grad)


@dataclass(frozen=True)
class _Algorithm:
    """How one family of torch optimizers maps onto a compiled update."""

    update: Callable[..., None]
    hyper: Callable[[Dict[str, Any]], List[float]]
    flags: Callable[[torch.optim.Optimizer, Dict[str, Any]], Tuple[bool, ...]]
    # The state tensors of one parameter, or None while the optimizer has not created them yet.
    state: Callable[[Dict[str, Any], Tuple[bool, ...]], Optional[List[Tensor]]]
    state_lists: int  # how many state lists follow (params, grads)


def _adam_state(state: Dict[str, Any], flags: Tuple[bool, ...]) -> Optional[List[Tensor]]:
    if "step" not in state:
        return None
    amsgrad = flags[0]
    return [state["exp_avg"], state["exp_avg_sq"], state["max_exp_avg_sq"] if amsgrad else None, state["step"]]


def _sgd_state(state: Dict[str, Any], flags: Tuple[bool, ...]) -> Optional[List[Tensor]]:
    if not flags[0]:
        return [None]
    buffer = state.get("momentum_buffer")
    return None if buffer is None else [buffer]


ADAM = _Algorithm(
    update=_adam_update,
    hyper=lambda g: [float(v) for v in (g["lr"], *g["betas"], g["eps"], g["weight_decay"])],
    flags=lambda opt, g: (
        bool(g.get("amsgrad")),
        bool(g.get("maximize")),
        bool(g.get("decoupled_weight_decay")) or isinstance(opt, torch.optim.AdamW),
    ),
    state=_adam_state,
    state_lists=4,
)
SGD = _Algorithm(
    update=_sgd_update,
    hyper=lambda g: [float(g[k]) for k in ("lr", "momentum", "dampening", "weight_decay")],
    flags=lambda opt, g: (g["momentum"] != 0, bool(g.get("nesterov")), bool(g.get("maximize"))),
    state=_sgd_state,
    state_lists=1,
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
    return algorithm
