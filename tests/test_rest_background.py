"""``rest: background``: the blocks compile in place at the first step; the parts around them (a ConvNeXt's stem,
downsampling layers, final norm and head) run eagerly until a background thread has compiled them. ``rest: auto``
(the bundled ``regional``'s) takes it on a GPU where it would otherwise leave those light parts eager."""

import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.callback import callback_handler

from compile_trainer import BackgroundCompile, CompileCallback, PolicyError, apply_policy, format_plan_table, to_policy
from compile_trainer.compiling.runtime_checks import background_compile_problem
from compile_trainer.planning.selection import resolve_plan
from tests.test_background import WaitForBackground
from tests.user_models import FAMILIES, UserData, UserModule, tiny_convnext

DOWNSAMPLING = [f"model.convnext.encoder.stages.{i}.downsampling_layer.{j}" for i in (1, 2, 3) for j in (0, 1)]
REST = ["model.convnext.embeddings", *DOWNSAMPLING, "model.convnext.layernorm", "model.classifier"]


# A torch too old to compile in the background (2.9) refuses rest: background before training, naming what it lacks.
PROBLEM = background_compile_problem(to_policy("regional").lowering)


def refused_where_unsupported(run):
    """Runs ``run``; True where this torch refused it, as it must refuse it."""
    if PROBLEM is None:
        run()
        return False
    with pytest.raises(PolicyError, match="rest: background needs .* which torch .* lacks"):
        run()
    return True


def rest_background(**settings):
    rule = {"name": "*", "action": "regional", "rest": "background"}
    return to_policy("regional", **({"backend": "aot_eager", "rules": [rule]} | settings))


def test_auto_takes_background_for_light_parts_where_allowed_and_eager_elsewhere():
    root = nn.ModuleDict({"model": tiny_convnext()})
    deferred = resolve_plan(root, to_policy("regional"), background_rest=True)
    rest = {r.name for r in deferred.regions if r.role == "rest"}
    assert rest == set(REST) and all(r.background for r in deferred.regions if r.role == "rest")
    assert not any(r.background for r in deferred.regions if r.role == "block")
    assert "eager until then (rest: background)" in "\n".join(deferred.notes)
    eager = resolve_plan(root, to_policy("regional"))  # what apply_policy asks for on a CPU
    assert not [r for r in eager.regions if r.role == "rest"], "the light parts left eager"
    assert "the code around them left eager, which compiles fewer graphs (rest: eager)" in "\n".join(eager.notes)
    assert "rest: background" not in "\n".join(eager.notes), "no road the CPU does not take"
    applied = apply_policy(nn.ModuleDict({"model": tiny_convnext()}), to_policy("regional", backend="aot_eager"))
    assert not applied.defers_compiles, "on a CPU the thread would take cores from training: rest: eager"
    applied.remove()


@pytest.mark.parametrize(
    "lowering, said",
    [
        ("auto", "on the thread (background_lowering: auto: thread)"),
        ("subprocess", "in its compile subprocess (background_lowering: subprocess)"),
    ],
)
def test_the_parts_lower_on_the_thread_unless_the_policy_says_where(lowering, said):
    """``background_lowering: auto``: the subprocess for a whole model's graphs beside eager steps, the thread for a
    few small parts (their kernels compiled far slower in the subprocess: ``CompilePolicy.lowering``)."""
    assert to_policy("full_background").lowering == "subprocess"
    assert to_policy("regional").lowering == "thread"
    assert to_policy("regional", background_lowering="subprocess").lowering == "subprocess"
    root, applied = nn.ModuleDict({"model": tiny_convnext()}), []
    policy = rest_background(backend="inductor", background_lowering=lowering)
    if refused_where_unsupported(lambda: applied.append(apply_policy(root, policy))):
        return
    assert f"eager until then (rest: background), Inductor's lowering {said}" in format_plan_table(applied[0])
    applied[0].remove()


def test_the_blocks_compile_at_the_first_step_and_the_rest_on_a_thread_with_eager_losses():
    torch.manual_seed(0)
    reference = tiny_convnext()
    model = tiny_convnext()
    model.load_state_dict(reference.state_dict())
    batches = FAMILIES["convnext"](1)

    def train(net, background=None, wait_at=None):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        losses = []
        for step in range(6):
            if step == wait_at:
                background.wait()  # deterministic for the test: the rest eager in steps 0-1, compiled from 2
            if background is not None:
                background.poll()
            loss = net(**batches[step % len(batches)]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    root, applied = nn.ModuleDict({"model": model}), []
    if refused_where_unsupported(lambda: applied.append(apply_policy(root, rest_background()))):
        return
    applied = applied[0]
    expected = train(reference)
    table = format_plan_table(applied)
    assert "regional rest (background)" in table and "compiled on a background thread after the first step" in table
    background = BackgroundCompile(applied)
    threads = []
    callback_handler.register_start_callback(lambda *args: threads.append(threading.current_thread().name))
    try:
        losses = train(model, background, wait_at=2)
    finally:
        callback_handler.clear()
    assert losses == pytest.approx(expected, rel=1e-4)
    assert background.installed and background.eager_steps == 2
    calls = {item.region.name: item.calls for item in applied.compiled}
    assert {name: calls[name] for name in REST} == dict.fromkeys(REST, 4), "the rest compiled from step 2 on"
    assert {calls[i.region.name] for i in applied.compiled if i.region.role == "block"} == {6}, "blocks from step 0"
    assert len(background.recorded) == len(REST), "only the rest's entries were recorded"
    assert "compile_trainer-background" in threads and threading.main_thread().name in threads
    applied.remove()


def test_a_lightning_fit_with_rest_background_runs_each_training_step_once():
    pl.seed_everything(0)
    module, made = UserModule("convnext"), []
    if refused_where_unsupported(lambda: made.append(CompileCallback(rest_background()))):
        return  # by the callback's construction, before any training
    callback = made[0]
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[callback, WaitForBackground(callback, 2)],
    )  # fmt: skip
    trainer.fit(module, datamodule=UserData("convnext"))
    assert len(module.losses) == 6 == trainer.global_step
    summary = callback.summary()
    assert callback.background.installed and summary["background_eager_steps"] == 2
    # step 0 compiled the blocks, step 1 ran beside the thread's compile (which competes for the interpreter): the
    # four steps after the install are the steady ones
    assert (summary["compile_steps"], summary["steady_steps"]) == (2, 4) and summary["steady_samples_per_s"] > 0
    assert summary["unique_graphs"] == 4 + len(REST), "one graph per block structure, one per part of the rest"
    assert summary["recompiles"] == 0 and summary["eager_fallbacks"] == 0, "waiting for the thread is no fallback"


@pytest.mark.parametrize("settings", [{"shapes": {"warmup": True}}, {"cache": {"dir": "/tmp/cache"}}])
def test_rest_background_is_refused_beside_what_decides_when_compiles_happen(settings):
    with pytest.raises(PolicyError, match="rest: background and .* do not go together .* use rest: compile"):
        rest_background(**settings)


def test_validation_and_checkpoints_under_rest_background_match_eager_training(tmp_path):
    """Validation runs while the thread compiles (the parts run eagerly in eval mode until the install), losses match
    eager training's, and the checkpoint's keys are the plain model's and load into it."""

    def fit(callbacks, directory):
        pl.seed_everything(0)
        module = UserModule("convnext")
        trainer = pl.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=1, default_root_dir=directory,
            callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module, datamodule=UserData("convnext"))
        return module, trainer

    eager, _ = fit([], tmp_path / "eager")
    made = []
    if refused_where_unsupported(lambda: made.append(CompileCallback(rest_background(), print_plan=False))):
        return
    module, trainer = fit([made[0]], tmp_path / "compiled")
    assert made[0].background.installed
    assert torch.stack(module.losses).tolist() == pytest.approx(torch.stack(eager.losses).tolist(), rel=1e-4)
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    assert list(checkpoint["state_dict"]) == list(eager.state_dict()), "no _orig_mod. or other renamed keys"
    fresh = UserModule("convnext")
    fresh.load_state_dict(checkpoint["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))


LLAMA_PARTS = ["model.model.embed_tokens", "model.model.norm", "model.model.rotary_emb"]


def test_auto_outer_compiles_the_parts_inside_its_break_in_the_background_where_allowed():
    """A decoder with enough weights outside its blocks is compiled around them (rest: auto takes outer); the
    parts inside the stack that runs eagerly around the blocks (embeddings, final norm, rotary table) are small
    graphs each, compiled on the thread after the first step where a background compile is allowed."""
    root = nn.ModuleDict({"model": UserModule("llama").model})
    deferred = resolve_plan(root, to_policy("regional"), background_rest=True)
    roles = {r.name: (r.role, r.background) for r in deferred.regions}
    assert roles["model"] == ("outer", False) and roles["model.model.layers.0"] == ("block", False)
    assert {name: roles[name] for name in LLAMA_PARTS} == dict.fromkeys(LLAMA_PARTS, ("rest", True))
    assert "inside model.model (run eagerly around the blocks) compiled as their own regions on a background" in (
        "\n".join(deferred.notes)
    )
    foreground = resolve_plan(root, to_policy("regional"))  # a CPU, a compile cache or bucket warm-up
    assert not any(r.background for r in foreground.regions) and {r.name for r in foreground.regions} == set(roles)
    explicit = resolve_plan(root, to_policy("regional", rules=[{"name": "*", "action": "regional", "rest": "outer"}]))
    assert not any(r.background for r in explicit.regions), "rest: outer asked for: every part at the first step"


def fit_eager_and_through_the_gpu_gate(monkeypatch, family, **config):
    """Six steps of ``family`` trained eagerly, then under the bundled ``regional`` with the GPU's gate for background
    compiles forced open on this CPU (the compiles, the thread and the Trainer are real), the install after step 2:
    (eager module, compiled module, callback)."""
    from compile_trainer.compiling import regions

    trainer_args = dict(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    pl.seed_everything(0)
    eager = UserModule(family, **config)
    pl.Trainer(**trainer_args).fit(eager, datamodule=UserData(family))
    monkeypatch.setattr(regions, "_may_compile_rest_in_background", lambda policy, device: True)
    pl.seed_everything(0)
    module = UserModule(family, **config)
    callback = CompileCallback("regional", backend="aot_eager", telemetry={"measure_flops": False})
    pl.Trainer(**trainer_args, callbacks=[callback, WaitForBackground(callback, 2)]).fit(
        module, datamodule=UserData(family)
    )
    return eager, module, callback


def test_a_fit_compiled_around_its_blocks_with_its_inner_parts_on_the_thread_trains_like_eager(monkeypatch):
    """The outer road with the parts inside its break deferred, in a Lightning fit (on a CPU through the GPU's gate):
    the losses of eager training, each training step run once, no recompile."""
    from compile_trainer.compiling import regions

    if PROBLEM is not None:  # this torch cannot compile in the background: even a GPU keeps the parts at the first step
        assert not regions._may_compile_rest_in_background(to_policy("regional"), torch.device("cuda"))
        return
    eager, module, callback = fit_eager_and_through_the_gpu_gate(monkeypatch, "llama")
    deferred = {item.region.name for item in callback.applied.compiled if item.region.background}
    assert deferred == set(LLAMA_PARTS) and callback.background.installed
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(eager.losses), rtol=1e-5, atol=1e-6)
    summary = callback.summary()
    assert len(module.losses) == 6 and summary["background_eager_steps"] == 2
    assert summary["recompiles"] == 0 and summary["graph_breaks"] == 0, callback.telemetry.compile.events


T5_UNREPEATED = ["model.encoder.block.0", "model.decoder.block.0"]


def test_blocks_no_other_block_shares_compile_on_the_thread_and_train_like_eager(monkeypatch):
    """T5's first block of each stack (the only one holding the relative position bias) is a structure of its own:
    a graph nothing reuses, so under rest: auto it compiles on the thread after the first step, which compiles only
    the two shared structures. In a Lightning fit (on a CPU through the GPU's gate): eager losses, each block's
    entry compiled once, no recompile when the later blocks first get block 0's compiled output."""
    layers = {"num_layers": 6, "num_decoder_layers": 6}
    root = nn.ModuleDict({"model": UserModule("t5", **layers).model})
    deferred = resolve_plan(root, to_policy("regional"), background_rest=True)
    background_blocks = [r.name for r in deferred.regions if r.role == "block" and r.background]
    assert background_blocks == T5_UNREPEATED
    assert "a structure no other block shares" in "\n".join(deferred.notes)
    assert not any(r.background for r in resolve_plan(root, to_policy("regional")).regions), "a CPU: first step"
    if PROBLEM is not None:
        return
    eager, module, callback = fit_eager_and_through_the_gpu_gate(monkeypatch, "t5", **layers)
    table = format_plan_table(callback.applied)
    assert "regional block (background)" in table and "eager until then (rest: auto)" in table, table
    assert callback.background.installed and callback.summary()["background_eager_steps"] == 2
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(eager.losses), rtol=1e-5, atol=1e-6)
    calls = {item.region.name: item.calls for item in callback.applied.compiled if item.region.role == "block"}
    assert {name: calls.pop(name) for name in T5_UNREPEATED} == dict.fromkeys(T5_UNREPEATED, 4), "from step 2"
    assert set(calls.values()) == {6}, "the shared structures compiled at the first step"
    stats = callback.telemetry.compile.regions
    assert all(stats[name].compiles == 1 for name in T5_UNREPEATED), "compiled once, on the thread"
    summary = callback.summary()
    assert summary["recompiles"] == 0 and summary["graph_breaks"] == 0, callback.telemetry.compile.events
