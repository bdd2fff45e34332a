"""The optimizer update as one Triton kernel per segment (``optimizer.kernel: triton``), reading each gradient
where backward left it. Without a GPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set
in conftest.py), on the CPU tensors themselves: the same kernel code, the same address table, the same blocks.
The models here have parameters of more than one block (``triton_update.BLOCK``), so whole and partial blocks
both run."""

import io

import pytest
import torch

# the module pytest imports this directory's test files as (tests/ has no __init__.py): importing it again as
# tests.test_optimizer would register its Dynamo backend twice
from test_optimizer import (
    STEPS,
    assert_same_params,
    fit,
    groups_of,
    max_relative_difference,
    resume_both_ways,
    train,
    warmup_cosine,
)
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from compile_trainer import PolicyError
from compile_trainer.optimizer import compile_optimizer
from compile_trainer.optimizer import triton_update as triton_kernels

TRITON = {"compile": "true", "kernel": "triton"}
# test_optimizer.py's optimizers, with SGD's learning rates small enough for the wider model not to diverge
OPTIMIZERS = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "Adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01, amsgrad=True),
    "SGD-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "SGD-dampening": lambda groups: torch.optim.SGD(groups, lr=1e-3, momentum=0.9, dampening=0.5, maximize=True),
}


def wide_model() -> nn.Module:
    """Parameters of 2 blocks and more (2,400 and 1,200 elements) besides small ones, none a multiple of a block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.LayerNorm(300), nn.GELU(), nn.Linear(300, 4))


def eager_and_triton(name: str, steps: int = STEPS, policy=None, eager_clip=None):
    eager = wide_model()
    optimizer = OPTIMIZERS[name](groups_of(eager))
    norms = train(
        eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine()), steps, clip=eager_clip
    )
    model = wide_model()
    optimizer = OPTIMIZERS[name](groups_of(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    step = compile_optimizer(optimizer, {**TRITON, **(policy or {})})
    train(model, optimizer, scheduler, steps)
    return eager, model, step, norms


def test_the_interpreter_runs_the_kernels_here():
    assert triton_kernels.interpreted() or torch.cuda.is_available(), "conftest.py sets TRITON_INTERPRET=1 on CPUs"
    assert max(p.numel() for p in wide_model().parameters()) > triton_kernels.BLOCK


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_triton_update_matches_eager_under_warmup_cosine(name):
    eager, model, step, _ = eager_and_triton(name)
    assert step.update.name == "triton"
    assert_same_params(eager, model)
    assert (step.eager_steps, step.compiled_steps) == (1, STEPS - 1), "only the state-creating first step is eager"
    assert step.update.launches == 2 * (STEPS - 1), "one launch per segment (param group) per step"


def test_gradients_are_read_where_backward_left_them():
    """No flat gradient buffer, no hooks: the kernel reads each parameter's own gradient tensor, in place."""
    model = wide_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    step = compile_optimizer(optimizer, TRITON)
    assert all(segment.grad is None for segment in step.layout.segments) and not step.layout.hooked
    train(model, optimizer, None, 2)
    grads = [p.grad for p in model.parameters()]
    addresses = [g.data_ptr() for g in grads]
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert [p.grad for p in model.parameters()] == grads, "the gradient tensors are the ones backward made"
    assert [g.data_ptr() for g in grads] == addresses
    assert step.compiled_steps == 2 and all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert step.update.blocks[0].addresses == tuple(p.grad.data_ptr() for p in groups_of(model)[0]["params"]), (
        "the table holds the gradients' own addresses"
    )


def test_misaligned_and_non_contiguous_gradients_are_read_correctly():
    """Gradients set by hand: a view at an odd offset (not 16-byte aligned: the kernel's unaligned variant) and a
    transposed (non-contiguous) one; the update matches eager."""
    models, optimizers = [], []
    for compiled in (False, True):
        model = wide_model()
        optimizer = OPTIMIZERS["AdamW"](groups_of(model))
        if compiled:
            compile_optimizer(optimizer, TRITON)
        models.append(model)
        optimizers.append(optimizer)
    for index in range(3):
        for model, optimizer in zip(models, optimizers):
            generator = torch.Generator().manual_seed(index)
            params = list(model.parameters())
            storage = torch.randn(1 + params[0].numel(), generator=torch.Generator().manual_seed(index))
            params[0].grad = storage[1:].view_as(params[0])  # 4 bytes past an aligned address
            params[4].grad = torch.randn(params[4].shape[::-1], generator=generator).t()
            for param in params[1:4] + params[5:]:
                param.grad = torch.full_like(param, 0.01 * (index + 1))
            assert not params[4].grad.is_contiguous() and params[0].grad.data_ptr() % 16 != 0
            optimizer.step()
    step = optimizers[1].step
    assert step.compiled_steps == 2 and {dict(c)["ALIGNED"] for _, c in step.update.specializations} == {False, True}
    assert_same_params(*models)


@pytest.mark.parametrize("clipping", ["clip_grad_norm", "clip_grad_value"])
@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov"])
def test_clipping_inside_the_kernel_matches_eager_clip_then_step(name, clipping):
    limit = {"clip_grad_norm": 0.05, "clip_grad_value": 0.01}[clipping]
    eager_clip = {"clip_grad_norm": clip_grad_norm_, "clip_grad_value": clip_grad_value_}[clipping]
    eager, model, step, norms = eager_and_triton(
        name, policy={clipping: limit}, eager_clip=lambda ps: eager_clip(ps, limit)
    )
    assert_same_params(eager, model)
    if clipping == "clip_grad_norm":
        assert max(norms) > limit and torch.allclose(step.grad_norm, norms[-1], rtol=1e-5)
        grads = [p.grad for p in model.parameters()]
        unclipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert torch.allclose(unclipped, norms[-1], rtol=1e-5), "the gradients themselves are left unclipped"


def test_200_scheduled_steps_with_clipping_compile_no_new_kernel():
    """OneCycleLR moves the LR and beta1 every step: the kernels' arguments change, their compile-time constants
    (which Triton compiles a kernel for) do not."""
    steps, max_norm = 200, 0.05
    eager, model = wide_model(), wide_model()
    schedules = []
    for each in (eager, model):
        optimizer = torch.optim.AdamW(groups_of(each), lr=1e-2, weight_decay=0.1)
        schedules.append(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps))
    step = compile_optimizer(schedules[1].optimizer, {**TRITON, "clip_grad_norm": max_norm})
    train(eager, schedules[0].optimizer, schedules[0], steps, clip=lambda ps: clip_grad_norm_(ps, max_norm))
    train(model, schedules[1].optimizer, schedules[1], 3)
    compiled_after_warmup = set(step.update.specializations)
    train(model, schedules[1].optimizer, schedules[1], steps - 3, first_step=3)
    assert step.update.specializations == compiled_after_warmup and len(compiled_after_warmup) == 2, (
        "one kernel per segment, compiled at the first step, none after"
    )
    assert {g["betas"][0] for g in schedules[1].optimizer.param_groups} != {0.9}, "the schedule really moved"
    assert_same_params(eager, model, atol=1e-5)
    assert max_relative_difference(model, eager) < 1e-5


@pytest.mark.parametrize("saved_by", ["triton", "eager"])
def test_state_dict_resumes_both_ways(saved_by):
    def fresh(compiled: bool):
        model = wide_model()
        optimizer = OPTIMIZERS["AdamW"](groups_of(model))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
        if compiled:
            compile_optimizer(optimizer, TRITON)
        return model, optimizer, scheduler

    model, optimizer, scheduler = fresh(saved_by == "triton")
    train(model, optimizer, scheduler, 6)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "sched": scheduler.state_dict()}, buffer)
    assert float(optimizer.state_dict()["state"][0]["step"]) == 6.0, "the kernel keeps the step counts"
    assert_same_params(*resume_both_ways(fresh, buffer, steps=6))


def test_kernel_choice_and_errors():
    cpu_step = compile_optimizer(OPTIMIZERS["AdamW"](groups_of(wide_model())), {"compile": "true"})
    assert cpu_step.update.name == "inductor", "kernel: auto compiles with Inductor off CUDA devices"
    with pytest.raises(PolicyError, match=r"invalid kernel 'cuda'. Valid values: auto, triton, inductor"):
        compile_optimizer(OPTIMIZERS["AdamW"](groups_of(wide_model())), {"compile": "true", "kernel": "cuda"})


def test_triton_kernel_off_cuda_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(PolicyError, match=r"kernel=triton: parameters on cpu \(the Triton kernel runs on CUDA"):
        compile_optimizer(OPTIMIZERS["AdamW"](groups_of(wide_model())), TRITON)


OPTIMIZER_TRITON = {"enabled": False, "optimizer": TRITON}


def test_lightning_gradient_clip_val_clips_once_inside_the_kernel(monkeypatch):
    clips = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clips.append(1) or clip_grad_norm(*a, **k))
    _, eager, _ = fit(gradient_clip_val=0.05, accumulate_grad_batches=2)
    clips.clear()
    trainer, model, callback = fit(OPTIMIZER_TRITON, gradient_clip_val=0.05, accumulate_grad_batches=2)
    step = callback.optimizer_steps[0]
    assert step.update.name == "triton" and (step.eager_steps, step.compiled_steps) == (1, 3)
    assert len(clips) == step.eager_steps, "clip_grad_norm_ only in the state-creating eager step, not by Lightning"
    assert trainer.gradient_clip_val == 0.05
    assert_same_params(eager, model)


def test_lightning_resumes_a_triton_checkpoint_in_eager_training(tmp_path):
    path = tmp_path / "saved.ckpt"
    trainer, _, _ = fit(OPTIMIZER_TRITON, steps=3)
    trainer.save_checkpoint(path)
    _, resumed_eager, _ = fit(steps=6, ckpt_path=path)
    _, resumed_triton, callback = fit(OPTIMIZER_TRITON, steps=6, ckpt_path=path)
    assert_same_params(resumed_eager, resumed_triton)
    assert callback.optimizer_steps[0].compiled_steps == 3


def test_auto_times_the_triton_kernel_against_fused():
    eager = wide_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(eager))
    train(eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine()), STEPS)
    model = wide_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    policy = {**TRITON, "compile": "auto", "auto_candidates": ["fused", "compiled"], "auto_steps": 2}
    step = compile_optimizer(optimizer, policy)
    train(model, optimizer, scheduler, STEPS)
    assert set(step.choice.step_ms) == {"fused", "compiled"} and step.update.launches >= 2 * 3
    assert_same_params(eager, model)
