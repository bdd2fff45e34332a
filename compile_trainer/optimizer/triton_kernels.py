"""The Triton kernels of the optimizer update (``triton_update.py`` launches them): one program per block of one
parameter, reading that parameter's gradient in place through the segment's address table and its parameter and
state from the segment's flat buffers (``flat.py``).

Each op is rounded as the CUDA kernels of torch's single-tensor step round it (the launch passes
``enable_fp_fusion=False``; a fused multiply-add only where those kernels have one). Clipping by norm reads the
total gradient norm the host side took into the step's ``grad_norm`` to compute the clip coefficient; clipping by
value clamps here. The gradients themselves are left unclipped.

Each kernel calls its block function from two branches, with ``MASKED`` false (a block whole within its parameter:
wide loads and stores) and with it true (a parameter's last block): ``MASKED`` must be a compile-time
constant, and whether a block is whole is known only at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate(
    pid,
    block_param_ptr,
    block_start_ptr,
    param_start_ptr,
    param_end_ptr,
    grad_table_ptr,
    param_ptr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's block: its offsets in the flat buffers, whether it lies whole within its parameter, the
    parameter's end there, and its gradient's pointers at those offsets."""
    index = tl.load(block_param_ptr + pid)
    start = tl.load(block_start_ptr + pid)
    first = tl.load(param_start_ptr + index)
    end = tl.load(param_end_ptr + index)
    address = tl.load(grad_table_ptr + index)
    if ALIGNED:  # every parameter starts at a multiple of ALIGNMENT elements, every gradient at 16 bytes
        start = tl.multiple_of(start, 16)
        first = tl.multiple_of(first, 16)
        address = tl.multiple_of(address, 16)
    offsets = start + tl.arange(0, BLOCK)
    grad_ptrs = address.to(param_ptr.dtype) + (offsets - first)
    if ALIGNED:  # runs of 16 contiguous elements, each starting 16-byte aligned: wide loads
        grad_ptrs = tl.max_contiguous(tl.multiple_of(grad_ptrs, [16]), [16])
    return offsets, start + BLOCK <= end, end, grad_ptrs


@triton.jit
def _clipped(grad, norm_ptr, clip_limit, CLIP_NORM: tl.constexpr, CLIP_VALUE: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The gradient as ``clip_grad_norm_`` (``clip_limit``: the max norm; ``norm_ptr``: the total norm) or
    ``clip_grad_value_`` (the max value) leaves it, rounded as they round."""
    if CLIP_NORM:  # min(max_norm / (norm + eps), 1); torch divides a float by a tensor as reciprocal, then times
        coefficient = tl.div_rn(1.0, tl.load(norm_ptr) + 1e-6) * clip_limit
        grad = grad * tl.minimum(coefficient, 1.0, propagate_nan=tl.PropagateNan.ALL)
    if CLIP_VALUE:  # NaN propagates, as through torch.clamp
        grad = tl.maximum(grad, -clip_limit, propagate_nan=tl.PropagateNan.ALL)
        grad = tl.minimum(grad, clip_limit, propagate_nan=tl.PropagateNan.ALL)
    if MAXIMIZE:
        grad = -grad
    return grad


@triton.jit
def _write_steps(pid, steps_ptr, step, n_params, STEPS_BLOCK: tl.constexpr):
    if pid == 0:
        index = tl.arange(0, STEPS_BLOCK)
        tl.store(steps_ptr + index, tl.full([STEPS_BLOCK], 0, tl.float32) + step, mask=index < n_params)


@triton.jit
def _adam_block(
    offsets,
    end,
    grad_ptrs,
    param_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,
    norm_ptr,
    neg_step_size,
    inv_bias_correction2_sqrt,
    eps,
    decay,
    weight_decay,
    avg_weight,
    beta2,
    sq_weight,
    clip_limit,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    CLIP_NORM: tl.constexpr,
    CLIP_VALUE: tl.constexpr,
    MASKED: tl.constexpr,
):
    mask = offsets < end if MASKED else None  # a whole block: no mask, so loads and stores can be wide
    grad = tl.load(grad_ptrs, mask=mask).to(tl.float32)
    grad = _clipped(grad, norm_ptr, clip_limit, CLIP_NORM, CLIP_VALUE, MAXIMIZE)
    param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    if DECOUPLED:
        param = param * decay
    else:
        grad = tl.fma(weight_decay, param, grad)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    # lerp as torch's kernel: from the start for weights below 0.5, else from the end
    diff = grad - exp_avg
    near, far = tl.fma(avg_weight, diff, exp_avg), tl.fma(avg_weight - 1.0, diff, grad)
    exp_avg = tl.where(tl.abs(avg_weight) < 0.5, near, far)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg_sq = tl.fma(sq_weight, grad * grad, exp_avg_sq * beta2)  # addcmul: value * (t1 * t2) + self
    tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if AMSGRAD:
        max_exp_avg_sq = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.maximum(max_exp_avg_sq, exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)  # as torch.maximum
        tl.store(max_exp_avg_sq_ptr + offsets, exp_avg_sq.to(max_exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    # a division by a host scalar is a multiplication by its float reciprocal in torch's CUDA kernel
    denom = tl.sqrt_rn(exp_avg_sq) * inv_bias_correction2_sqrt + eps
    param = tl.fma(neg_step_size, tl.div_rn(exp_avg, denom), param)  # addcdiv: value * (t1 / t2) + self
    tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)


@triton.jit
def adam_kernel(
    param_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,
    steps_ptr,
    grad_table_ptr,
    block_param_ptr,
    block_start_ptr,
    param_start_ptr,
    param_end_ptr,
    norm_ptr,
    n_params,
    step,
    neg_step_size,
    inv_bias_correction2_sqrt,
    eps,
    decay,
    weight_decay,
    avg_weight,
    beta2,
    sq_weight,
    clip_limit,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    CLIP_NORM: tl.constexpr,
    CLIP_VALUE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets, whole, end, grad_ptrs = _locate(
        pid, block_param_ptr, block_start_ptr, param_start_ptr, param_end_ptr, grad_table_ptr, param_ptr, ALIGNED, BLOCK
    )
    if whole:
        _adam_block(
            offsets,
            end,
            grad_ptrs,
            param_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            max_exp_avg_sq_ptr,
            norm_ptr,
            neg_step_size,
            inv_bias_correction2_sqrt,
            eps,
            decay,
            weight_decay,
            avg_weight,
            beta2,
            sq_weight,
            clip_limit,
            AMSGRAD,
            MAXIMIZE,
            DECOUPLED,
            CLIP_NORM,
            CLIP_VALUE,
            MASKED=False,
        )
    else:
        _adam_block(
            offsets,
            end,
            grad_ptrs,
            param_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            max_exp_avg_sq_ptr,
            norm_ptr,
            neg_step_size,
            inv_bias_correction2_sqrt,
            eps,
            decay,
            weight_decay,
            avg_weight,
            beta2,
            sq_weight,
            clip_limit,
            AMSGRAD,
            MAXIMIZE,
            DECOUPLED,
            CLIP_NORM,
            CLIP_VALUE,
            MASKED=True,
        )
    _write_steps(pid, steps_ptr, step, n_params, STEPS_BLOCK)


@triton.jit
def _sgd_block(
    offsets,
    end,
    grad_ptrs,
    param_ptr,
    buf_ptr,
    norm_ptr,
    neg_lr,
    momentum,
    grad_weight,
    weight_decay,
    clip_limit,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    CLIP_NORM: tl.constexpr,
    CLIP_VALUE: tl.constexpr,
    MASKED: tl.constexpr,
):
    mask = offsets < end if MASKED else None  # a whole block: no mask, so loads and stores can be wide
    grad = tl.load(grad_ptrs, mask=mask).to(tl.float32)
    grad = _clipped(grad, norm_ptr, clip_limit, CLIP_NORM, CLIP_VALUE, MAXIMIZE)
    param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    grad = tl.fma(weight_decay, param, grad)  # add with alpha: alpha * other + self
    if HAS_MOMENTUM:
        buf = tl.load(buf_ptr + offsets, mask=mask).to(tl.float32)
        buf = tl.fma(grad_weight, grad, buf * momentum)
        tl.store(buf_ptr + offsets, buf.to(buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            grad = tl.fma(momentum, buf, grad)
        else:
            grad = buf
    param = tl.fma(neg_lr, grad, param)
    tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sgd_kernel(
    param_ptr,
    buf_ptr,
    grad_table_ptr,
    block_param_ptr,
    block_start_ptr,
    param_start_ptr,
    param_end_ptr,
    norm_ptr,
    neg_lr,
    momentum,
    grad_weight,
    weight_decay,
    clip_limit,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    CLIP_NORM: tl.constexpr,
    CLIP_VALUE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets, whole, end, grad_ptrs = _locate(
        pid, block_param_ptr, block_start_ptr, param_start_ptr, param_end_ptr, grad_table_ptr, param_ptr, ALIGNED, BLOCK
    )
    if whole:
        _sgd_block(
            offsets,
            end,
            grad_ptrs,
            param_ptr,
            buf_ptr,
            norm_ptr,
            neg_lr,
            momentum,
            grad_weight,
            weight_decay,
            clip_limit,
            HAS_MOMENTUM,
            NESTEROV,
            MAXIMIZE,
            CLIP_NORM,
            CLIP_VALUE,
            MASKED=False,
        )
    else:
        _sgd_block(
            offsets,
            end,
            grad_ptrs,
            param_ptr,
            buf_ptr,
            norm_ptr,
            neg_lr,
            momentum,
            grad_weight,
            weight_decay,
            clip_limit,
            HAS_MOMENTUM,
            NESTEROV,
            MAXIMIZE,
            CLIP_NORM,
            CLIP_VALUE,
            MASKED=True,
        )
