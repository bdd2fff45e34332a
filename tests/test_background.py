import contextlib
import copy
import functools
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

from compile_trainer import (
    BackgroundCompile,
    BackgroundCompileError,
    CompileCallback,
    PolicyError,
    apply_policy,
    compat,
    format_plan_table,
    to_policy,
)
from compile_trainer.compiling.background import shadow_module
from compile_trainer.compiling.runtime_checks import background_compile_problem
from tests.conftest import TINY_GPT, Wrapper
from tests.test_apply import fit_tiny

# Torch before 2.11 refuses background compiles before training, saying why (tests/test_policy.py checks the refusal).
BACKGROUND_PROBLEM = background_compile_problem()
needs_background_compile = pytest.mark.skipif(
    BACKGROUND_PROBLEM is not None, reason=f"background compiles: {BACKGROUND_PROBLEM}"
)


class CompileThreads:
    """The thread each compile (Dynamo frame or lazy backward) starts on."""

    def __init__(self):
        self.names = []
        callback_handler.register_start_callback(self._record)

    def _record(self, *args):
        self.names.append(threading.current_thread().name)

    def remove(self):
        callback_handler.remove_start_callback(self._record)


def train(model, steps, background=None, on_step=None, context=contextlib.nullcontext):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [torch.randint(0, TINY_GPT.vocab_size, (4, 9)) for _ in range(4)]
    losses = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        if background is not None:
            background.poll()
        batch = batches[step % len(batches)]
        with context():
            _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# As Lightning's bf16 mixed precision runs a step: Dynamo guards on the autocast state and its cache flag,
# so the background thread must compile under the same state or the first compiled step recompiles.
AUTOCAST = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, cache_enabled=False)


@needs_background_compile
def test_regions_compile_on_a_thread_while_steps_run_eagerly_and_losses_match(tiny_gpt):
    reference = copy.deepcopy(tiny_gpt)
    expected = train(reference, 12, context=AUTOCAST)
    applied = apply_policy(Wrapper(tiny_gpt), to_policy("regional_split", backend="aot_eager", background=True))
    background = BackgroundCompile(applied)
    threads = CompileThreads()
    graphs_at_install = []

    def wait_at_step_2(step):
        if step == 2:
            background.wait()  # deterministic for the test: steps 0-1 eager, compiled from step 2
            graphs_at_install.append(counters["stats"]["unique_graphs"])

    try:
        losses = train(tiny_gpt, 12, background, wait_at_step_2, context=AUTOCAST)
    finally:
        threads.remove()
    assert losses == pytest.approx(expected, rel=1e-3)  # bf16 autocast: compiled and eager round differently
    assert background.installed and background.eager_steps == 2
    calls = {item.region.name: item.calls for item in applied.compiled}
    assert calls.pop("head") == 0 and set(calls.values()) == {10}, "every model region compiled from step 2 on"
    assert counters["stats"]["unique_graphs"] == graphs_at_install[0], "no compile after the install"
    assert threads.names and set(threads.names) == {"compile_trainer-background"}, (
        "forward and backward graphs all compiled on the background thread, none in a training step"
    )
    assert len(background.recorded) == 3, "one recorded call per compiled entry: embed, the blocks' one, head"


class Normalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


@needs_background_compile
def test_the_background_call_leaves_buffers_and_gradients_alone():
    torch.manual_seed(0)
    model = Normalized()
    reference = copy.deepcopy(model)
    background = BackgroundCompile(apply_policy(Wrapper(model), to_policy("full", backend="aot_eager")))
    x = torch.randn(16, 4)
    for net in (model, reference):
        net(x).sum().backward()  # the first step: eager, recorded
    background.poll()
    background.wait()  # the thread ran the region once more, on a shadow
    assert background.installed
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), f"{name} changed by the background compile"
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


@needs_background_compile
def test_a_region_that_fails_to_compile_is_reported_at_the_next_step_with_its_name():
    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x * 2

    root = nn.Sequential(Breaks())
    policy = to_policy({"rules": [{"name": "0", "fullgraph": True}], "backend": "eager", "background": True})
    background = BackgroundCompile(apply_policy(root, policy))
    root(torch.ones(2, requires_grad=True))
    background.poll()
    background._thread.join()
    # named with Dynamo's reason and the user line it traced last
    where = r"region '0' failed \(Unsupported: .* at test_background\.py:\d+ `torch\._dynamo\.graph_break\(\)`\)"
    with pytest.raises(BackgroundCompileError, match=where):
        background.poll()


def test_background_with_bucket_warmup_or_nested_regions_is_refused_before_training():
    with pytest.raises(PolicyError, match="background: true and shapes.warmup: true"):
        to_policy("buckets", background=True)
    with pytest.raises(PolicyError, match="rest: nested"):
        to_policy("regional_nested", background=True)
    with pytest.raises(PolicyError, match="rest: auto .*may resolve to outer"):
        to_policy("regional", background=True)
    with pytest.raises(PolicyError, match="rest: outer"):
        to_policy("regional", background=True, rules=[{"name": "*", "action": "regional", "rest": "outer"}])


class WaitForBackground(pl.Callback):
    """Makes the switch happen at a known step, so the test does not depend on the thread's speed."""

    def __init__(self, compile_callback, step):
        self.compile_callback, self.step = compile_callback, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.step - 1:
            self.compile_callback.background.wait()


@needs_background_compile
def test_lightning_fit_switches_to_compiled_regions_and_matches_eager():
    _, _, eager = fit_tiny(None, steps=6)
    callback = CompileCallback(to_policy("regional_split", backend="aot_eager", background=True), print_plan=False)
    _, _, losses = fit_tiny(None, steps=6, callbacks=[callback, WaitForBackground(callback, 2)])
    assert losses == pytest.approx(eager, rel=1e-4)
    assert callback.background.installed
    assert "compiled on a background thread" in format_plan_table(callback.applied)
    assert callback.summary()["background_eager_steps"] == 2
    assert all(item.calls == 4 for item in callback.applied.compiled)
    assert callback.summary()["steady_steps"] == 4, "the eager steps before the switch are not steady state"


@needs_background_compile
def test_evaluation_calls_are_not_compiled_in_the_background(tiny_gpt):
    background = BackgroundCompile(apply_policy(Wrapper(tiny_gpt), to_policy("regional_split", backend="aot_eager")))
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8))
    tiny_gpt.eval()
    with torch.no_grad():
        tiny_gpt(tokens, tokens)  # as Lightning's sanity check before training
    assert not background.poll() and background.state == "recording" and not background.recorded
    tiny_gpt.train()
    tiny_gpt(tokens, tokens)[1].backward()
    background.poll()
    assert background.state == "compiling" and len(background.recorded) == 3
    background.close()
    assert background.installed


def test_the_shadow_aliases_parameters_memory_but_not_their_autograd_state():
    """The thread traces a shadow: the trained parameters' ``.grad`` (set and cleared by the training thread's
    backward meanwhile) is never read from the thread; tied weights stay tied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    model[1].weight = model[0].weight  # tied, as a language model's head
    model(torch.tensor([1, 2])).sum().backward()
    shadow = shadow_module(model)
    originals, aliases = list(model.parameters()), list(shadow.parameters())
    assert len(aliases) == len(originals) == 2, "the tied weight appears once in the shadow too"
    assert shadow[1].weight is shadow[0].weight
    for original, alias in zip(originals, aliases):
        assert alias is not original and alias.grad is None and original.grad is not None
        assert alias.data_ptr() == original.data_ptr() and alias.requires_grad == original.requires_grad


@torch.library.custom_op("compile_trainer_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


scaled.register_autograd(lambda ctx, grad: grad * 3)


class Scaled(nn.Linear):
    def forward(self, x):
        return scaled(super().forward(x))


class TwoRegions(nn.Module):
    """``plain`` lowers in the subprocess; ``custom`` calls an op the subprocess never registered."""

    def __init__(self):
        super().__init__()
        self.plain = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.custom = Scaled(4, 4)

    def forward(self, x):
        return self.custom(self.plain(x))


@needs_background_compile
def test_inductor_lowers_background_graphs_in_a_subprocess_where_they_pickle():
    torch.manual_seed(0)
    model = TwoRegions()
    reference = copy.deepcopy(model)
    rules = [{"name": "plain", "action": "full"}, {"name": "custom", "action": "full"}]
    background = BackgroundCompile(apply_policy(model, to_policy({"rules": rules, "background": True})))
    assert "Inductor's lowering in its compile subprocess" in format_plan_table(background.applied)
    x = torch.randn(8, 4)
    for net in (model, reference):
        net(x).sum().backward()  # the first step: eager, recorded
    with compat.fresh_inductor_cache():  # a cache hit lowers nothing
        background.poll()
        background.wait()
    for net in (model, reference):
        net(x).pow(2).sum().backward()  # compiled, against eager
    for name, parameter in reference.named_parameters():
        assert torch.allclose(model.get_parameter(name).grad, parameter.grad, atol=1e-6), name
    summary = background.summary()
    # plain's forward and backward graphs in the subprocess, and custom's backward (its op's backward is a
    # multiplication); custom's forward (an op the subprocess never registered) on the thread
    assert summary["background_lowering"] == "subprocess"
    assert summary["background_graphs_lowered_in_subprocess"] == 3
    reason = "the graph does not pickle (Unable to pickle non-standard op: torch.ops.compile_trainer_test.scaled"
    assert summary["background_graphs_lowered_on_thread"] == 1
    [(why, graphs)] = summary["background_lowered_on_thread_because"].items()
    assert why.startswith(reason) and graphs == 1, summary
    assert f"3 graphs lowered in a subprocess, 1 on the thread: {reason}" in background.describe()


@needs_background_compile
def test_lowering_on_the_thread_where_asked_or_where_nothing_is_lowered():
    thread = to_policy("full_background", background_lowering="thread")
    background = BackgroundCompile(apply_policy(Wrapper(Normalized()), thread))
    assert background.lowering == "thread" and "compile subprocess" not in format_plan_table(background.applied)
    background.close()
    eager = to_policy("full_background", backend="eager")
    eager_backend = BackgroundCompile(apply_policy(Wrapper(Normalized()), eager))
    assert eager_backend.lowering == "thread", "only Inductor lowers graphs"
    eager_backend.close()


def test_an_unknown_background_lowering_is_refused_with_the_valid_ones():
    valid = "Valid values: auto, subprocess, thread"
    for policy in ("full_background", "regional"):  # rest: auto may take rest: background, which lowers too
        with pytest.raises(PolicyError, match=f"invalid background_lowering 'process'. {valid}"):
            to_policy(policy, background_lowering="process")


class MetricsSeen(pl.loggers.Logger):
    """A Lightning logger that keeps what it was given."""

    name, version = "seen", 0

    def __init__(self):
        super().__init__()
        self.metrics = {}

    def log_metrics(self, metrics, step=None):
        self.metrics |= metrics

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@needs_background_compile
def test_the_background_compile_logs_numbers_only_to_lightning_loggers():
    """TensorBoard's logger takes numbers only: the lowering's name and reasons stay in the summary."""
    from compile_trainer.lightning.callback import _log_background

    background = BackgroundCompile(apply_policy(Wrapper(Normalized()), to_policy("full_background", backend="eager")))
    background.close()
    seen = MetricsSeen()
    _log_background(pl.Trainer(logger=[seen], enable_progress_bar=False), background)
    assert seen.metrics and all(isinstance(v, (int, float)) for v in seen.metrics.values()), seen.metrics
    assert seen.metrics["compile/background_graphs_lowered_on_thread"] == 0
    assert "compile/background_lowering" not in seen.metrics and "background_lowering" in background.summary()


@needs_background_compile
def test_a_compile_stopped_at_the_end_of_training_leaves_the_other_regions_to_their_first_call(tiny_gpt):
    """``close(finish=False)`` (``CompileCallback`` at the end of a fit the compile outlasted): the thread finishes
    the region it is compiling and compiles no other; those compile at their first call, with the same losses."""
    reference = copy.deepcopy(tiny_gpt)
    expected = train(reference, 4)
    applied = apply_policy(Wrapper(tiny_gpt), to_policy("regional_split", backend="aot_eager", background=True))
    background = BackgroundCompile(applied)

    def stop_once_the_thread_compiles(*args):
        if threading.current_thread().name == "compile_trainer-background":
            background.stop_after_region()

    def end_training_at_step_1(step):  # step 0 ran eagerly and was recorded
        if step == 1:
            background.poll()  # starts the thread, which stops after its first region
            background.close(finish=False)

    callback_handler.register_start_callback(stop_once_the_thread_compiles)
    threads = CompileThreads()
    try:
        losses = train(tiny_gpt, 4, background, end_training_at_step_1)
    finally:
        callback_handler.remove_start_callback(stop_once_the_thread_compiles)
        threads.remove()
    assert background.installed and (background.regions_compiled, len(background.recorded)) == (1, 3)
    assert "1 of 3 regions" in background.describe() and "2 compile at their first call" in background.describe()
    assert background.summary()["background_regions_compiled"] == 1
    assert threading.main_thread().name in threads.names, "the regions the thread did not reach compiled here"
    assert losses == pytest.approx(expected, rel=1e-5)
