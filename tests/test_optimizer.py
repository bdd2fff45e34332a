"""The compiled optimizer step: parity with torch's optimizers, no recompiles under LR schedules, standard state,
and the closure / accumulation / clipping / mixed-precision / manual-optimization paths in a real Trainer."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch._dynamo import register_backend
from torch._dynamo.utils import counters, get_compilation_metrics
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from compile_trainer import CompileCallback, PolicyError, to_policy
from compile_trainer.optimizer import compile_optimizer
from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.runs.training import build_callback
from compile_trainer.schema import OptimizerPolicy, optimizer_settings
from compile_trainer_recipes.data import StdlibTextDataModule
from compile_trainer_recipes.gpt import LanguageModel
from tests.benchmark_smoke import ROOT, WITHOUT_CONFIG_PACKAGES
from tests.conftest import TINY_GPT, quiet_cpu_trainer

STEPS = 30
OPTIMIZERS = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "Adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01, amsgrad=True),
    "SGD-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "SGD-dampening": lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9, dampening=0.5, maximize=True),
}


def warmup_cosine(warmup: int = 5, total: int = STEPS):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return factor


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def groups_of(model: nn.Module):
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def train(model, optimizer, scheduler, steps, first_step=0, clip=None):
    """``steps`` closure steps on data that depends only on the step number (so runs can resume); ``clip``:
    a function of the parameters the closure calls after backward (eager clipping, as Lightning does)."""
    norms = []
    for step in range(first_step, first_step + steps):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

        def closure(inputs=inputs):
            optimizer.zero_grad()
            loss = model(inputs).pow(2).mean()
            loss.backward()
            if clip is not None:
                norms.append(clip(model.parameters()))
            return loss

        loss = optimizer.step(closure)
        assert loss is not None and loss.requires_grad, "step returns the closure's loss, computed with grad"
        if scheduler is not None:
            scheduler.step()
    return norms


def assert_same_params(a: nn.Module, b: nn.Module, atol: float = 1e-6):
    """fp32 updates: the compiled and eager steps round differently in the last bits (a few fp32 ulps per step),
    hence ``rtol=1e-5`` and ``atol=1e-6`` for weights of order 0.01-1 over a handful of steps."""
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(x, y, rtol=1e-5, atol=atol), f"{name}: max diff {(x - y).abs().max():.2e}"


def resume_both_ways(fresh, buffer: io.BytesIO, steps: int) -> list:
    """Load the checkpoint in ``buffer`` into a compiled and an eager (model, optimizer, scheduler) from ``fresh``,
    train each ``steps`` more steps; the compiled one must use the loaded state at once. Returns both models."""
    resumed = []
    for compiled in (True, False):
        model, optimizer, scheduler = fresh(compiled)
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["opt"])
        scheduler.load_state_dict(checkpoint["sched"])
        train(model, optimizer, scheduler, steps, first_step=steps)
        if compiled:
            assert optimizer.step.compiled_steps == steps, "the loaded state (and its step count) is used at once"
        resumed.append(model)
    return resumed


def mixed_precision_atol(lr: float, steps: int, dtype: torch.dtype) -> float:
    """How far two runs whose fp32 weights differ in the last bits may drift under ``dtype`` autocast.

    A difference of one fp32 ulp in a weight can flip the rounding of a ``dtype`` activation, which changes
    a gradient by up to ``eps(dtype)`` relative; Adam normalizes gradients, so an update of size ``lr`` then
    changes by up to about ``lr * eps(dtype)``, at each step. Whether a rounding flips depends on the CPU's
    kernels (AMX / avx512-bf16 round differently from the plain path), so the bound is derived, not measured.
    """
    return steps * lr * torch.finfo(dtype).eps


class CompileLog:
    """The compiles of one optimizer's step since this was made (Dynamo's metrics are process-wide)."""

    def __init__(self, entry_name: str):
        self.entry_name = entry_name
        self.seen = {id(m) for m in get_compilation_metrics()}

    def compile_ids(self):
        new = [m for m in get_compilation_metrics() if id(m) not in self.seen]
        return [str(m.compile_id) for m in new if m.co_name == self.entry_name]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_match_eager_with_warmup_cosine(name):
    eager = tiny_model()
    optimizer = OPTIMIZERS[name](groups_of(eager))
    train(eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine()), STEPS)

    compiled = tiny_model()
    optimizer = OPTIMIZERS[name](groups_of(compiled))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    step = compile_optimizer(optimizer, {"compile": "true", "backend": "aot_eager"})
    post_hook_calls = []
    optimizer.register_step_post_hook(lambda *_: post_hook_calls.append(1))
    compiles = CompileLog(step.update.entry_name)
    train(compiled, optimizer, scheduler, STEPS)

    assert_same_params(eager, compiled)
    assert (step.eager_steps, step.compiled_steps) == (1, STEPS - 1), "only the state-creating first step is eager"
    assert len(post_hook_calls) == STEPS, "step hooks run on compiled steps too"
    assert len(compiles.compile_ids()) == 1


def test_inductor_step_with_clipping_never_recompiles_over_200_scheduled_steps():
    """OneCycleLR warms up and anneals (cosine) the LR and cycles beta1 on every step, and the gradients are
    clipped by norm in the same compiled function: one compile, no more, and the same parameters as eager."""
    steps, max_norm = 200, 0.05
    eager, compiled = tiny_model(), tiny_model()
    schedules = []
    for model in (eager, compiled):
        optimizer = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
        schedules.append(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps))
    policy = {"compile": "true", "clip_grad_norm": max_norm}
    step = compile_optimizer(schedules[1].optimizer, policy, backend="inductor")
    graphs_before, compiles = counters["stats"]["unique_graphs"], CompileLog(step.update.entry_name)
    norms = train(eager, schedules[0].optimizer, schedules[0], steps, clip=lambda ps: clip_grad_norm_(ps, max_norm))
    train(compiled, schedules[1].optimizer, schedules[1], steps)
    assert 0 < sum(n > max_norm for n in norms) < steps, "steps with and without clipping"
    assert torch.allclose(step.grad_norm, norms[-1], rtol=1e-5), "the last step's total norm, as clip_grad_norm_"

    ids = compiles.compile_ids()
    assert len(ids) == 1 and ids[0].endswith("/0"), f"one compile, no recompile: {ids}"
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert step.compiled_steps == steps - 1
    betas = {g["betas"][0] for g in schedules[1].optimizer.param_groups}
    assert schedules[1].optimizer.param_groups[0]["lr"] < 1e-3 and betas != {0.9}, "the schedule really moved"
    assert_same_params(eager, compiled, atol=1e-5)


@pytest.mark.parametrize("clipping", ["clip_grad_norm", "clip_grad_value"])
@pytest.mark.parametrize("name", ["AdamW", "Adam-amsgrad", "SGD-nesterov"])
def test_clipping_in_the_step_matches_eager_clip_then_step(name, clipping):
    limit = {"clip_grad_norm": 0.05, "clip_grad_value": 0.01}[clipping]
    eager_clip = {"clip_grad_norm": clip_grad_norm_, "clip_grad_value": clip_grad_value_}[clipping]
    eager = tiny_model()
    optimizer = OPTIMIZERS[name](groups_of(eager))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    norms = train(eager, optimizer, scheduler, STEPS, clip=lambda ps: eager_clip(ps, limit))

    compiled = tiny_model()
    optimizer = OPTIMIZERS[name](groups_of(compiled))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    step = compile_optimizer(optimizer, {"compile": "true", "backend": "aot_eager", clipping: limit})
    train(compiled, optimizer, scheduler, STEPS)

    assert_same_params(eager, compiled)
    assert (step.eager_steps, step.compiled_steps) == (1, STEPS - 1)
    assert len(step.layout.segments) == 2, "one flat segment per param group"
    if clipping == "clip_grad_norm":
        assert torch.allclose(step.grad_norm, norms[-1], rtol=1e-5)
        assert max(norms) > limit, "clipping was active"


def for_loop_adamw(model: nn.Module) -> torch.optim.AdamW:
    """torch's single-tensor AdamW, the implementation the compiled update follows op for op."""
    return torch.optim.AdamW(groups_of(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest parameter difference, relative to each tensor's largest value (the benchmark's measure)."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "backend,max_norm",
    [("aot_eager", None), ("aot_eager", 0.05), ("inductor", 0.05)],
    ids=["aot", "aot-clip", "ind-clip"],
)
def test_100_steps_within_1e_6_of_for_loop_adamw(backend, max_norm):
    """Parity with eager: warm-up + cosine over 100 steps, gradients from backward, clipping by norm
    (clip_grad_norm_ over the param groups' parameters, in their order, for eager)."""
    steps, schedule = 100, warmup_cosine(10, 100)
    eager = tiny_model()
    optimizer = for_loop_adamw(eager)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip = None if max_norm is None else lambda _: clip_grad_norm_(params, max_norm)
    norms = train(eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), steps, clip=clip)

    compiled = tiny_model()
    optimizer = for_loop_adamw(compiled)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    step = compile_optimizer(optimizer, {"compile": "true", "clip_grad_norm": max_norm}, backend=backend)
    train(compiled, optimizer, scheduler, steps)

    assert max_relative_difference(compiled, eager) < 1e-6
    assert step.compiled_steps == steps - 1
    if max_norm is not None:
        assert max(norms) > max_norm > min(norms), "clipped at times"
        assert torch.allclose(step.grad_norm, norms[-1], rtol=1e-6)


def total_norm(params) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def test_clipping_norm_is_of_the_gradients_as_they_are_at_the_step():
    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    step = compile_optimizer(optimizer, {"compile": "true", "backend": "aot_eager", "clip_grad_norm": 1e-3})
    params = list(model.parameters())
    train(model, optimizer, None, 1)  # the state-creating eager step

    def backward(scale: float = 1.0, zero: bool = True) -> None:
        if zero:
            optimizer.zero_grad()
        (
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(int(scale * 10)))).pow(2).mean() * scale
        ).backward()

    backward()
    backward(2.0, zero=False)  # accumulation: added into the flat buffer's views in place
    expected = total_norm(params)
    optimizer.step()
    assert torch.allclose(step.grad_norm, expected, rtol=1e-6)

    backward()
    params[0].grad.mul_(3.0)  # changed after backward (as clip_grad_norm_ or an in-place unscale would)
    expected = total_norm(params)
    optimizer.step()
    assert torch.allclose(step.grad_norm, expected, rtol=1e-6)
    for param in params:
        param.grad = param.grad.clone() * 0.5  # set by hand: gathered at the step
    expected_by_hand = total_norm(params)
    optimizer.step()
    assert torch.allclose(step.grad_norm, expected_by_hand, rtol=1e-6) and not torch.allclose(
        expected, expected_by_hand
    )
    ids = CompileLog(step.update.entry_name)
    backward()
    optimizer.step()
    assert ids.compile_ids() == [], "gradients from backward or set by hand: the same compiled graph"


def test_parameters_and_state_are_views_of_flat_buffers_and_missing_gradients_fall_back():
    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    step = compile_optimizer(optimizer, {"compile": "true", "backend": "eager"})
    train(model, optimizer, None, 3)
    segment = step.layout.segments[0]
    for param in segment.params:
        assert param.untyped_storage().data_ptr() == segment.param.untyped_storage().data_ptr()
        assert param.grad.untyped_storage().data_ptr() == segment.grad.untyped_storage().data_ptr()
        state = optimizer.state[param]
        assert state["exp_avg"].untyped_storage().data_ptr() == segment.state[0].untyped_storage().data_ptr()
        assert state["step"].shape == () and float(state["step"]) == 3.0
    assert (step.eager_steps, step.compiled_steps) == (1, 2)
    buffers = list(segment.state)
    step.eager_step("by hand")  # updates the views in place: the next compiled step keeps the same buffers
    train(model, optimizer, None, 1, first_step=3)
    assert step.compiled_steps == 3 and all(a is b for a, b in zip(buffers, segment.state))

    optimizer.zero_grad()  # set_to_none: backward makes new gradients, which the hooks gather into the buffer
    model(torch.ones(2, 8)).sum().backward()
    assert all(p.grad is view for p, view in zip(segment.params, segment.grad_views))
    gathered = segment.grad.clone()
    model(torch.ones(2, 8)).sum().backward()
    assert torch.equal(segment.grad, 2 * gathered), "a second backward accumulates in place"

    reference = tiny_model()
    reference_optimizer = OPTIMIZERS["AdamW"](groups_of(reference))
    train(reference, reference_optimizer, None, 3)
    reference_optimizer.step()  # as the step by hand, on the same gradients
    train(reference, reference_optimizer, None, 1, first_step=3)
    last = list(model.parameters())[-1]
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        opt.zero_grad()
        net(torch.ones(2, 8)).sum().backward()
        list(net.parameters())[-1].grad = None  # a parameter without a gradient this step: Adam skips it
        opt.step()
    assert step.eager_steps == 3 and "gradients: group 1 (4,) has none" in step.eager_reasons
    assert_same_params(reference, model)
    assert float(optimizer.state[last]["step"]) == 5.0 and float(optimizer.state[model[0].weight]["step"]) == 6.0
    train(model, optimizer, None, 1, first_step=5)
    train(reference, reference_optimizer, None, 1, first_step=5)
    assert "param group 1: parameters have different step counts" in step.eager_reasons, "its own step, still exact"
    assert_same_params(reference, model)


def test_a_parameter_unfrozen_after_install_is_updated_by_the_optimizers_own_step():
    models, steps = [], []
    for compiled in (False, True):
        model = tiny_model()
        model[0].weight.requires_grad_(False)
        optimizer = OPTIMIZERS["AdamW"](groups_of(model))
        if compiled:
            steps.append(compile_optimizer(optimizer, {"compile": "true", "backend": "eager"}))
        train(model, optimizer, None, 3)
        model[0].weight.requires_grad_(True)
        train(model, optimizer, None, 2, first_step=3)
        models.append(model)
    assert_same_params(*models)
    assert "gradients: frozen at install (16, 8) has one now" in steps[0].eager_reasons
    assert steps[0].compiled_steps == 2 and not torch.equal(models[1][0].weight, tiny_model()[0].weight)


def test_a_param_group_added_after_install_runs_the_optimizers_own_step():
    models, steps = [], []
    for compiled in (False, True):
        model = tiny_model()
        optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        if compiled:
            steps.append(compile_optimizer(optimizer, {"compile": "true", "backend": "eager"}))
        train(model, optimizer, None, 2)
        optimizer.add_param_group({"params": list(model[3].parameters()), "lr": 1e-3})
        train(model, optimizer, None, 2, first_step=2)
        models.append(model)
    assert_same_params(*models)
    assert (steps[0].eager_steps, steps[0].compiled_steps) == (3, 1)
    assert any("param groups changed" in reason for reason in steps[0].eager_reasons)


def test_plateau_schedule_and_changed_weight_decay_do_not_recompile():
    model = tiny_model()
    optimizer = torch.optim.SGD(groups_of(model), lr=0.1, momentum=0.9, weight_decay=0.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    step = compile_optimizer(optimizer, {"compile": "true", "backend": "eager"})
    compiles = CompileLog(step.update.entry_name)
    for index in range(12):
        train(model, optimizer, None, 1, first_step=index)
        plateau.step(float(index))  # a rising metric: the LR halves every step
        optimizer.param_groups[0]["weight_decay"] = 1e-3 * index
    assert optimizer.param_groups[0]["lr"] < 0.1 / 2**8
    assert len(compiles.compile_ids()) == 1


@pytest.mark.parametrize("saved_by", ["compiled", "eager"])
def test_state_dict_resumes_both_ways_with_identical_updates(saved_by):
    def fresh(compiled: bool):
        model = tiny_model()
        optimizer = OPTIMIZERS["AdamW"](groups_of(model))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
        if compiled:
            compile_optimizer(optimizer, {"compile": "true", "backend": "aot_eager"})
        return model, optimizer, scheduler

    model, optimizer, scheduler = fresh(saved_by == "compiled")
    train(model, optimizer, scheduler, 8)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "sched": scheduler.state_dict()}, buffer)
    eager_state = fresh(False)[1].state_dict()
    saved = optimizer.state_dict()
    assert saved["param_groups"][0].keys() == eager_state["param_groups"][0].keys(), "standard param groups"
    assert all(type(g["lr"]) is float for g in saved["param_groups"]), "scheduled values stay plain floats"
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    assert_same_params(*resume_both_ways(fresh, buffer, steps=8))


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_grad_scaler_unscales_and_skips_overflowing_steps_as_with_eager(max_norm):
    """The fp16 mixed-precision path: GradScaler.step(optimizer) without a closure; the scaler unscales the
    gradients in place before the step, which takes the clipping norm from the unscaled gradients."""
    models, steps = [], []
    for compiled in (False, True):
        model = tiny_model()
        optimizer = OPTIMIZERS["AdamW"](groups_of(model))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        if compiled:
            policy = {"compile": "true", "backend": "aot_eager", "clip_grad_norm": max_norm}
            steps.append(compile_optimizer(optimizer, policy))
        for index in range(6):
            optimizer.zero_grad()
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(index))
            loss = model(inputs).pow(2).mean() * (math.inf if index == 3 else 1.0)
            scaler.scale(loss).backward()
            if max_norm is not None and not compiled:
                scaler.unscale_(optimizer)
                clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_norm)
            scaler.step(optimizer)
            scaler.update()
        models.append(model)
    assert_same_params(*models)
    assert (steps[0].eager_steps, steps[0].compiled_steps) == (1, 4), "the overflowing step was skipped"


def trial_counts(candidates, auto_steps: int, chosen: str, clipping: bool) -> tuple:
    """(compiled steps, eager steps) of ``STEPS`` under ``auto``: a first step that creates the state, each candidate's
    warm-up and timed steps, then the winner's; an eager winner without clipping gets the optimizer's own step back,
    whose steps are not this step's."""
    turns = 1 + auto_steps
    after = STEPS - 1 - len(candidates) * turns
    compiled = turns * ("compiled" in candidates) + after * (chosen == "compiled")
    eager = 1 + turns * sum(c != "compiled" for c in candidates) + after * (chosen != "compiled" and clipping)
    return compiled, eager


def expected_flags(optimizer, chosen: str) -> list:
    """The fused/foreach flags after the choice: the user's own under the compiled winner, else the winner's."""
    if chosen == "compiled":
        return [(None, None)] * len(optimizer.param_groups)
    return [(chosen == "fused", chosen == "foreach")] * len(optimizer.param_groups)


def test_auto_times_every_candidate_keeps_the_fastest_and_updates_stay_equal():
    """Which candidate wins is the timing's business; that each ran its warm-up and timed steps, that the fastest
    is kept and that the steps after the trial are the winner's is not."""
    eager = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(eager))
    train(eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine()), STEPS)

    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    choices = []
    policy = {"compile": "auto", "backend": "aot_eager", "auto_steps": 2}
    step = compile_optimizer(optimizer, policy, on_choice=choices.append)
    train(model, optimizer, scheduler, STEPS)

    assert len(choices) == 1 and step.choice is choices[0]
    choice = choices[0]
    assert set(choice.step_ms) == {"fused", "foreach", "compiled"}
    assert step.eager_reasons["auto is timing fused"] == step.eager_reasons["auto is timing foreach"] == 3
    assert choice.chosen == min(choice.step_ms, key=choice.step_ms.get)
    assert f"auto chose {choice.chosen}" in choice.describe() and "best of 2 timed steps" in choice.describe()
    candidates = ["fused", "foreach", "compiled"]
    assert (step.compiled_steps, step.eager_steps) == trial_counts(candidates, 2, choice.chosen, clipping=False)
    assert (optimizer.step is step) == (choice.chosen == "compiled"), "an eager winner gets its own step back"
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == expected_flags(optimizer, choice.chosen)
    assert_same_params(eager, model)


@pytest.mark.parametrize("candidates", [["foreach"], ["compiled"], ["fused", "compiled"]])
def test_auto_with_clipping_keeps_clipping_whichever_candidate_wins(candidates):
    """One candidate: its win is certain, so each kind of winner is tested on every run; two: either."""
    eager = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(eager))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    train(eager, optimizer, scheduler, STEPS, clip=lambda ps: clip_grad_norm_(ps, 0.05))

    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    policy = {"compile": "auto", "auto_candidates": candidates, "auto_steps": 3, "backend": "aot_eager"}
    policy["clip_grad_norm"] = 0.05
    step = compile_optimizer(optimizer, policy)
    train(model, optimizer, scheduler, STEPS)
    chosen = step.choice.chosen
    assert chosen in candidates and optimizer.step is step, "an eager winner runs behind the step"
    assert set(step.choice.step_ms) == set(candidates) and "clipping by norm 0.05 included" in step.choice.describe()
    assert (step.compiled_steps, step.eager_steps) == trial_counts(candidates, 3, chosen, clipping=True)
    assert step.eager_choice == (None if chosen == "compiled" else chosen)
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == expected_flags(optimizer, chosen)
    assert_same_params(eager, model)


@pytest.mark.parametrize("candidates", [["compiled"], ["foreach"], ["foreach", "compiled"]])
def test_auto_times_the_compiled_candidate_with_its_gradient_copy(candidates):
    """During the trial no hook copies gradients in backward, where the timing would miss it: the compiled
    candidate gathers them inside its timed step. A compiled winner gets its hooks back; an eager one reads
    gradients where backward left them."""
    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    policy = {"compile": "auto", "auto_candidates": candidates, "auto_steps": 2, "backend": "aot_eager"}
    step = compile_optimizer(optimizer, {**policy, "clip_grad_norm": 0.05})
    assert not step.layout.hooked, "off from the start: the first backward already feeds the trial"
    train(model, optimizer, None, STEPS)
    compiled_won = step.choice.chosen == "compiled"
    assert step.layout.hooked == compiled_won
    flat_grads = {segment.grad.data_ptr() for segment in step.layout.segments}
    in_flat_buffer = [p.grad._base is not None and p.grad._base.data_ptr() in flat_grads for p in model.parameters()]
    assert in_flat_buffer == [compiled_won] * len(in_flat_buffer), "else backward's own gradient tensors"


def test_auto_trial_eager_candidates_read_gradients_where_backward_left_them():
    """As in training: torch's steps read backward's own gradient tensors; only the compiled candidate's calls
    gather them into its flat buffer (and pay for it in their timing)."""
    model = tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    flat_grads = []  # at each step: whether every gradient is a view of a flat buffer
    optimizer.register_step_pre_hook(lambda *_: flat_grads.append(all(p.grad._base is not None for p in params)))
    params = list(model.parameters())
    policy = {"compile": "auto", "auto_candidates": ["foreach", "compiled"], "auto_steps": 2, "backend": "aot_eager"}
    step = compile_optimizer(optimizer, policy)
    train(model, optimizer, None, 7)
    # the state-creating step, the warm-ups (foreach, compiled), then two rounds of foreach, compiled
    assert flat_grads[:7] == [True, True, True, False, True, False, True] and step.choice is not None


def test_auto_with_one_eager_candidate_restores_the_optimizer_step():
    model = tiny_model()
    optimizer = OPTIMIZERS["SGD-nesterov"](groups_of(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    own_step = optimizer.step  # the scheduler's tracking wrapper
    step = compile_optimizer(optimizer, {"compile": "auto", "auto_candidates": ["foreach"], "auto_steps": 1})
    train(model, optimizer, scheduler, 4)
    assert step.choice.chosen == "foreach" and optimizer.step == own_step
    assert optimizer.param_groups[0]["foreach"] is True and step.compiled_steps == 0


class MarkedTensor(torch.Tensor):
    """A tensor subclass, as DTensor is."""


@register_backend
def failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_auto_drops_a_compiled_candidate_that_fails_to_compile():
    eager, model = tiny_model(), tiny_model()
    optimizer = OPTIMIZERS["AdamW"](groups_of(eager))
    train(eager, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine()), 10)
    optimizer = OPTIMIZERS["AdamW"](groups_of(model))
    policy = {"compile": "auto", "auto_candidates": ["compiled", "foreach"], "backend": "failing_backend"}
    step = compile_optimizer(optimizer, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine())
    train(model, optimizer, scheduler, 8)
    assert step.choice is None, "the failed candidate's turns still run (eagerly): a trial as long on every rank"
    train(model, optimizer, scheduler, 2, first_step=8)
    assert step.choice.chosen == "foreach" and set(step.choice.step_ms) == {"foreach"}
    assert "compile failed" in step.choice.skipped["compiled"] and "cannot compile anything" in step.choice.describe()
    assert_same_params(eager, model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compile_optimizer(sgd, {"compile": "true", "backend": "failing_backend"})
    with pytest.raises(Exception, match="cannot compile anything"):  # compile: true has no fallback
        train(model, sgd, None, 2)


def test_unsupported_optimizers_and_bad_settings_are_clear_errors():
    model = tiny_model()
    with pytest.raises(PolicyError, match=r"cannot compile torch.optim.rmsprop.RMSprop: supported .*Adam, AdamW, SGD"):
        compile_optimizer(torch.optim.RMSprop(model.parameters()))
    with pytest.raises(PolicyError, match="differentiable=True, not supported"):
        compile_optimizer(torch.optim.Adam(model.parameters(), differentiable=True))
    assert compile_optimizer(torch.optim.RMSprop(model.parameters()), {"compile": "false"}) is None
    subclassed = nn.Parameter(torch.zeros(2).as_subclass(MarkedTensor))
    with pytest.raises(PolicyError, match=r"tensor subclasses \(MarkedTensor, e.g. DTensor under FSDP\)"):
        compile_optimizer(torch.optim.SGD([subclassed], lr=0.1))
    with pytest.raises(PolicyError, match="invalid compile 'yes'. Valid values: true, false, auto"):
        to_policy({"enabled": False, "optimizer": {"compile": "yes"}})
    with pytest.raises(PolicyError, match=r"invalid auto_candidates \['fastest'\]. Give one or more of: fused"):
        to_policy({"enabled": False, "optimizer": {"compile": "auto", "auto_candidates": ["fastest"]}})
    with pytest.raises(PolicyError, match="optimizer: invalid mode 'turbo'"):
        to_policy({"enabled": False, "optimizer": {"mode": "turbo"}})
    assert to_policy({"enabled": False, "optimizer": {"compile": True}}).optimizer.compile == "true"
    assert isinstance(to_policy("regional").optimizer, OptimizerPolicy)


def test_optimizer_section_composes_through_hydra():
    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="compil"):
            compose("config", overrides=["compile.optimizer.compil=true"])
        overrides = ["compile.optimizer.compile=true", "compile.optimizer.auto_candidates=[foreach,compiled]"]
        cfg = compose("config", overrides=overrides)
    policy = build_callback(cfg).policy.optimizer
    assert policy.compile == "true" and policy.auto_candidates == ["foreach", "compiled"]
    assert optimizer_settings(policy).fullgraph, "the optimizer's update is compiled fullgraph unless it says otherwise"


# ---- in a real Lightning Trainer ----


class ManualLanguageModel(LanguageModel):
    """Manual optimization: the user calls backward, clipping, step and the scheduler."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler.step()
        return loss


class RMSpropLanguageModel(LanguageModel):
    training_steps = 0

    def training_step(self, batch, batch_idx):
        RMSpropLanguageModel.training_steps += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


def fit(policy=None, module_class=LanguageModel, steps=4, ckpt_path=None, **trainer_args):
    pl.seed_everything(0)
    module = module_class(model=vars(TINY_GPT) | {"block_size": 32, "vocab_size": 256}, warmup_steps=2, decay_steps=8)
    callback = CompileCallback(policy, print_plan=False) if policy else None
    trainer = quiet_cpu_trainer(max_steps=steps, callbacks=[callback] if callback else [], **trainer_args)
    data = StdlibTextDataModule(block_size=32, batch_size=4, max_bytes=100_000)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, callback


OPTIMIZER_ONLY = {"enabled": False, "backend": "aot_eager", "optimizer": {"compile": "true"}}


def test_lightning_closure_accumulation_clipping_and_bf16_match_eager():
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed")
    _, eager, _ = fit(**settings)
    trainer, compiled, callback = fit(OPTIMIZER_ONLY, **settings)
    lr = trainer.lr_scheduler_configs[0].scheduler.base_lrs[0]  # the schedule's peak
    assert_same_params(eager, compiled, atol=mixed_precision_atol(lr, trainer.global_step, torch.bfloat16))
    step = callback.optimizer_steps[0]
    assert trainer.optimizers[0].step is step and (step.eager_steps, step.compiled_steps) == (1, 3)
    assert trainer.global_step == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] != 1e-3, "the LR schedule ran"
    row = callback.telemetry.compile.regions["optimizer_step_AdamW"]
    assert (row.compiles, row.recompiles) == (1, 0), "the telemetry attributes the optimizer's compile to it"


def test_lightning_gradient_clip_val_clips_once_inside_the_compiled_step(monkeypatch):
    """The Trainer's clipping moves into the compiled step: Lightning does not clip a second time, the updates
    match Lightning's eager clipping, and the step's total gradient norm is there to log."""
    clips = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clips.append(1) or clip_grad_norm(*a, **k))
    _, eager, _ = fit(gradient_clip_val=0.05)
    assert len(clips) == 4, "Lightning clips once per step eagerly"
    clips.clear()
    trainer, compiled, callback = fit(OPTIMIZER_ONLY, gradient_clip_val=0.05)
    step = callback.optimizer_steps[0]
    assert (step.eager_steps, step.compiled_steps) == (1, 3) and step.clip == (0.05, None)
    assert len(clips) == step.eager_steps, "clip_grad_norm_ only in the state-creating eager step, not by Lightning"
    assert trainer.gradient_clip_val == 0.05, "the Trainer's setting is restored at teardown"
    assert_same_params(eager, compiled)
    grads = [p.grad for p in compiled.parameters()]  # the last step's gradients, left unclipped
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 0.05 and torch.allclose(step.grad_norm, norm, rtol=1e-5)


def test_clipping_declared_twice_and_differently_is_an_error_before_training():
    policy = {**OPTIMIZER_ONLY, "optimizer": {"compile": "true", "clip_grad_norm": 1.0}}
    with pytest.raises(PolicyError, match="clips by norm 1 and the trainer asks to clip by value 0.5; set one"):
        fit(policy, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    with pytest.raises(PolicyError, match="give clip_grad_norm or clip_grad_value, not both"):
        to_policy({"enabled": False, "optimizer": {"clip_grad_norm": 1.0, "clip_grad_value": 1.0}})
    with pytest.raises(PolicyError, match=r"clip_grad_value must be > 0 \(or null: no clipping\), got -1"):
        to_policy({"enabled": False, "optimizer": {"clip_grad_value": -1}})


def test_lightning_manual_optimization_matches_eager():
    _, eager, _ = fit(module_class=ManualLanguageModel)
    _, compiled, callback = fit(OPTIMIZER_ONLY, module_class=ManualLanguageModel)
    assert_same_params(eager, compiled)
    assert callback.optimizer_steps[0].compiled_steps == 3


@pytest.mark.parametrize("saved_by", ["eager", "compiled"])
def test_lightning_resumes_checkpoints_both_ways(tmp_path, saved_by):
    clip, path = {"gradient_clip_val": 0.05}, tmp_path / "saved.ckpt"
    trainer, _, _ = fit(OPTIMIZER_ONLY if saved_by == "compiled" else None, steps=3, **clip)
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in key for key in checkpoint["state_dict"])
    (optimizer_state,) = checkpoint["optimizer_states"]
    assert set(optimizer_state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optimizer_state["state"][0]["step"].shape == () and float(optimizer_state["state"][0]["step"]) == 3.0
    _, resumed_eager, _ = fit(steps=6, ckpt_path=path, **clip)
    _, resumed_compiled, callback = fit(OPTIMIZER_ONLY, steps=6, ckpt_path=path, **clip)
    assert_same_params(resumed_eager, resumed_compiled)
    assert callback.optimizer_steps[0].compiled_steps == 3, "the restored state needs no eager first step"


def test_lightning_auto_logs_its_choice(tmp_path):
    auto = {"compile": "auto", "auto_candidates": ["foreach", "compiled"], "auto_steps": 1}
    policy = {**OPTIMIZER_ONLY, "optimizer": auto}
    trainer, _, callback = fit(policy, steps=6, logger=CSVLogger(tmp_path))
    choice = callback.optimizer_steps[0].choice
    assert choice is not None and set(choice.step_ms) == {"foreach", "compiled"}
    hparams = yaml.safe_load(next(tmp_path.glob("**/hparams.yaml")).read_text())
    assert hparams["optimizer_choice"]["chosen"] == choice.chosen
    assert hparams["compile_policy"]["optimizer"]["compile"] == "auto"


def test_lightning_unsupported_optimizer_fails_before_training():
    with pytest.raises(PolicyError, match="supported optimizers are Adam, AdamW, SGD"):
        fit(OPTIMIZER_ONLY, module_class=RMSpropLanguageModel)
    assert RMSpropLanguageModel.training_steps == 0


def test_benchmark_smoke_runs_without_config_packages(tmp_path):
    """The Triton rows run through Triton's interpreter (TRITON_INTERPRET=1, from conftest.py)."""
    from benchmarks import optimizer as bench

    out = tmp_path / "optimizer.json"
    command = [sys.executable, "-c", WITHOUT_CONFIG_PACKAGES, "benchmarks/optimizer.py", "--smoke", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compile_trainer auto + clip: chose" in result.stdout
    data = json.loads(out.read_text())
    rows = {row["variant"]: row for row in data["rows"]}
    roads = ["eager for-loop", "foreach", "fused"] + [
        f"compile_trainer{kernel}" for kernel in ("", " inductor", " auto")
    ]
    assert list(rows) == bench.VARIANTS == [road + clip for road in roads for clip in ("", " + clip")]
    assert data["benchmark"] == "optimizer"
    assert not any(row.get("error") for row in rows.values()), [row.get("error") for row in rows.values()]
    for name in [name for name in rows if name.startswith("compile_trainer") and "auto" not in name]:
        ours, triton = rows[name], "inductor" not in name
        assert ours["recompiles"] == 0 and ours["compiled_steps"] == 19
        assert ours["frames_compiled"] == (0 if triton else 1) and ours.get("kernels_compiled") == (
            2 if triton else None
        )
        assert ours["kernel"].startswith("Triton kernel" if triton else "torch.compile backend=aot_eager")
        assert ours["max_rel_diff_at_100"] < 1e-6 and ours["max_abs_diff"] < 1e-6, "as the for-loop AdamW"
        assert ours["step_ms"] > 0 and ours["vs_fused"] > 0 and ours["ratio"] == pytest.approx(1 / ours["vs_fused"])
        reference = rows["fused + clip" if name.endswith(" + clip") else "fused"]
        assert ours["ratio"] == pytest.approx(ours["step_ms"] / reference["step_ms"]), "against the same clipping"
    assert rows["eager for-loop + clip"]["max_abs_diff"] == 0.0, "the clipped rows' parity reference"
    assert rows["fused"]["ratio"] == 1.0 and rows["foreach"]["max_rel_diff_at_100"] < 1e-5
    assert rows["compile_trainer auto + clip"]["auto_choice"]["chosen"] in {"fused", "foreach", "compiled"}
