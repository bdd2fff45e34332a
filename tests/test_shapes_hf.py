"""The bundled ``dynamic`` and ``buckets`` policies on Hugging Face batches (``input_ids``, ``attention_mask``,
``labels``), as they come: entries found by role, zero recompiles over a stream of new lengths."""

import pytest
import torch
from torch._dynamo.utils import get_compilation_metrics
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, ShapeError, to_policy
from compile_trainer.shapes.batch import BatchShaper
from compile_trainer.shapes.region_inputs import RecompileError
from tests.conftest import quiet_cpu_trainer
from tests.user_models import VOCAB, UserModule

LENGTHS = list(range(6, 46, 2))  # 20 distinct lengths


def hf_stream(lengths=LENGTHS, batch=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return batches


def fit_stream(family, policy, stream, **overrides):
    callback = CompileCallback(policy, backend="eager", telemetry={"measure_flops": False}, **overrides)
    module = UserModule(family, **({} if family == "bert" else {"use_cache": False}))
    trainer = quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, train_dataloaders=DataLoader(stream, batch_size=None))
    return module, callback


def frame_recompiles():
    """Compiles of a frame that already had compiled code, from Dynamo's own metrics (compile id "n/k", k > 0)."""
    return [m for m in get_compilation_metrics() if not str(m.compile_id).endswith("/0")]


@pytest.mark.parametrize("policy", ["dynamic", "dynamic_full"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_dynamic_never_recompiles_on_a_stream_of_new_lengths(family, policy):
    _, callback = fit_stream(family, policy, hf_stream())
    assert frame_recompiles() == [], [(m.compile_id, m.recompile_reason) for m in frame_recompiles()]
    assert callback.summary()["recompiles"] == 0
    marked = {d.entry for d in callback.policy.shapes.dynamic}
    assert marked >= {"@tokens", "@labels"}, "the bundled policy names roles, not the recipe's entries"


def test_roles_resolve_against_the_batch_and_a_batch_without_them_is_named():
    shaper = BatchShaper(to_policy("dynamic").shapes)
    batch = hf_stream([8])[0]
    shaper(batch)
    assert shaper.resolved == {"@tokens": "input_ids", "@attention_mask": "attention_mask", "@labels": "labels"}
    assert {d.entry for d in shaper.shapes.dynamic} == {"input_ids", "attention_mask", "labels"}
    recipe = BatchShaper(to_policy("dynamic").shapes)
    recipe({"inputs": torch.zeros(2, 8, dtype=torch.long), "targets": torch.zeros(2, 8, dtype=torch.long)})
    assert recipe.resolved == {"@tokens": "inputs", "@labels": "targets"}
    with pytest.raises(ShapeError, match=r"none of the entries .*@tokens.* entries seen: x: \(2, 8\) int64"):
        BatchShaper(to_policy("dynamic").shapes)({"x": torch.zeros(2, 8, dtype=torch.long)})


def test_an_override_replaces_the_bundled_pad_values():
    policy = to_policy("buckets", shapes={"pad": {"values": {"input_ids": 0, "labels": -100}}})
    assert policy.shapes.pad.values == {"input_ids": 0, "labels": -100}
    with pytest.raises(Exception, match="unknown role '@token'"):
        to_policy("buckets", shapes={"pad": {"values": {"@token": 0}}})


def test_buckets_pad_hf_batches_by_role_without_changing_training_and_compile_in_warm_up():
    # lengths in 3 of the 4 bundled buckets (32, 64, 96, 128); 32 and 64 fill theirs exactly: no padding, so
    # Hugging Face drops the all-ones mask: a path of its own through the blocks, compiled at its first batch
    stream = hf_stream([*range(6, 60, 3), 32, 64])
    module, callback = fit_stream("llama", "buckets", stream)
    recompiles = [e for e in callback.telemetry.compile.events if e.kind == "recompile"]
    assert [(e.region, e.step) for e in recompiles] == [("model.model.layers", 18)], (
        "only the first batch without padding compiled in training (the blocks without a mask); warm-up then "
        "compiled that path at the other buckets, so the full batch of 64 compiled nothing"
    )
    assert callback.shape_hooks is None, "the batch hooks are removed at teardown"
    eager = UserModule("llama", use_cache=False)
    quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0).fit(
        eager, train_dataloaders=DataLoader(stream, batch_size=None)
    )
    assert len(module.losses) == len(stream), "warm-up ran no training_step"
    # padded to buckets (ids and mask 0, labels -100) and compiled, training is the unpadded eager training
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(eager.losses), rtol=1e-4, atol=1e-5)
    padded = BatchShaper(callback.policy.shapes).pad(stream[0])
    assert padded["input_ids"].shape[1] == 32 and (padded["labels"][:, 6:] == -100).all()


def test_chosen_buckets_pad_least_of_every_set_of_that_many():
    import itertools
    import random

    from compile_trainer.shapes.buckets import LengthSample, choose_buckets, padded_positions

    rng = random.Random(0)
    for _ in range(100):
        samples = [LengthSample(rng.randint(1, 60), rng.randint(1, 4)) for _ in range(rng.randint(1, 10))]
        count, multiple_of = rng.randint(1, 4), rng.choice([1, 8])
        chosen = choose_buckets(samples, count, multiple_of)
        top = -(-max(s.length for s in samples) // multiple_of) * multiple_of
        lower = sorted({-(-s.length // multiple_of) * multiple_of for s in samples} - {top})
        every = [list(c) + [top] for n in range(count) for c in itertools.combinations(lower, n)]
        assert len(chosen) <= count and chosen[-1] == top and all(b % multiple_of == 0 for b in chosen)
        assert padded_positions(samples, chosen)[1] == min(padded_positions(samples, b)[1] for b in every)


def test_auto_buckets_come_from_the_training_batches_and_leave_training_unchanged():
    from compile_trainer.shapes.buckets import LengthSample, choose_buckets, padding_overhead

    rng = torch.Generator().manual_seed(1)
    stream = hf_stream([int(n) for n in torch.randint(5, 60, (16,), generator=rng)])
    for batch in stream:  # as a collator pads: the rows after the first are shorter, padded at the end
        length = batch["input_ids"].shape[1]
        for row, cut in enumerate(torch.randint(1, length, (3,), generator=rng), start=1):
            batch["input_ids"][row, cut:], batch["attention_mask"][row, cut:], batch["labels"][row, cut:] = 0, 0, -100
    auto = {"count": 3, "sample_batches": 16, "multiple_of": 4}

    def loader():
        torch.manual_seed(0)  # shuffled: reading the lengths first must not change the order training sees
        return DataLoader(stream, batch_size=None, shuffle=True)

    callback = CompileCallback(
        "buckets_auto", backend="eager", telemetry={"measure_flops": False}, shapes={"pad": {"auto": auto}}
    )
    module = UserModule("llama", use_cache=False)
    trainer = quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, train_dataloaders=loader())
    eager = UserModule("llama", use_cache=False)
    quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0).fit(eager, train_dataloaders=loader())

    samples = [LengthSample(b["input_ids"].shape[1], 4) for b in stream]
    expected = choose_buckets(samples, 3, 4)
    summary = callback.summary()
    assert summary["buckets"] == expected and len(expected) == 3
    assert summary["expected_padding_overhead"] == pytest.approx(padding_overhead(samples, expected))
    assert summary["padding_overhead"] == pytest.approx(padding_overhead(samples, expected)), "all 16 batches seen"
    assert summary["recompiles"] == 0, callback.telemetry.compile.events
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(eager.losses), rtol=1e-4, atol=1e-5)


def test_auto_buckets_are_checked_before_training():
    with pytest.raises(Exception, match=r"auto.count must be >= 1"):
        to_policy("buckets_auto", shapes={"pad": {"auto": {"count": 0}}})
    with pytest.raises(Exception, match=r"give one of buckets, multiple_of, powers_of_two, auto, not buckets and auto"):
        to_policy("buckets", shapes={"pad": {"auto": {"count": 2}}})
    with pytest.raises(Exception, match=r"max \(100\) must be a multiple of auto.multiple_of \(8\)"):
        to_policy("buckets_auto", shapes={"pad": {"max": 100}})
    with pytest.raises(ShapeError, match="has not chosen its buckets yet"):
        BatchShaper(to_policy("buckets_auto").shapes).pad(hf_stream([8])[0])


@pytest.mark.parametrize("policy", ["dynamic", "dynamic_full"])
def test_dynamic_with_inductor_adds_no_size_guard_of_its_own(policy):
    """The real Inductor on a stream of new lengths: no recompile, the same losses as eager; the regions are
    compiled with the options that keep Inductor's own size checks from guarding (where this torch has them).
    ``dynamic_full`` pads to multiples of 16 here (this model's 64 positions would leave one padded length)."""
    from compile_trainer.compat import inductor_options_without_size_guards

    stream = hf_stream(list(range(6, 30, 4)))
    padded = {"shapes": {"pad": {"multiple_of": 16}}} if policy == "dynamic_full" else {}
    callback = CompileCallback(policy, telemetry={"measure_flops": False}, **padded)
    module = UserModule("gpt2", use_cache=False)
    quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0, callbacks=[callback]).fit(
        module, train_dataloaders=DataLoader(stream, batch_size=None)
    )
    eager = UserModule("gpt2", use_cache=False)
    quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0).fit(
        eager, train_dataloaders=DataLoader(stream, batch_size=None)
    )
    assert frame_recompiles() == [], [(m.compile_id, m.recompile_reason) for m in frame_recompiles()]
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(eager.losses), rtol=1e-4, atol=1e-5)
    for item in callback.applied.compiled:
        assert inductor_options_without_size_guards().items() <= item.region.settings.options.items()


def test_dynamic_turns_cudnn_attention_off_on_the_gpu_while_applied():
    """cuDNN attention builds a plan per new length (host-bound steps on an H100): off while a dynamic policy is
    applied to a model on the GPU, back on after; on while lengths are padded to a few (each plan built once).
    Nothing runs on the device: the policy is only applied."""
    from compile_trainer.compiling.process_settings import CUDNN_ATTENTION_OFF
    from compile_trainer.compiling.regions import apply_policy

    assert torch.backends.cuda.cudnn_sdp_enabled()
    on_cpu = apply_policy(UserModule("llama", use_cache=False), to_policy("dynamic"), device=torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled() and CUDNN_ATTENTION_OFF not in on_cpu.notes
    on_cpu.remove()
    on_gpu = apply_policy(UserModule("llama", use_cache=False), to_policy("dynamic"), device=torch.device("cuda"))
    assert not torch.backends.cuda.cudnn_sdp_enabled() and CUDNN_ATTENTION_OFF in on_gpu.notes
    on_gpu.remove()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    padded = to_policy("dynamic", shapes={"pad": {"multiple_of": 64, "values": {"@tokens": 0, "@labels": -100}}})
    padded_on_gpu = apply_policy(UserModule("llama", use_cache=False), padded, device=torch.device("cuda"))
    assert torch.backends.cuda.cudnn_sdp_enabled() and CUDNN_ATTENTION_OFF not in padded_on_gpu.notes
    padded_on_gpu.remove()


class ValidatedModule(UserModule):
    """Records its validation losses too."""

    def __init__(self, family, **config):
        super().__init__(family, **config)
        self.val_losses = []

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.val_losses.append(loss.detach().clone())
        return loss


def fit_with_validation(family, train, val, callback=None):
    module = ValidatedModule(family, **({} if family == "bert" else {"use_cache": False}))
    callbacks = [callback] if callback else []
    trainer = quiet_cpu_trainer(
        max_steps=len(train), limit_val_batches=len(val), num_sanity_val_steps=0, callbacks=callbacks
    )
    trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    return module


@pytest.mark.parametrize("policy", ["buckets", "dynamic", "dynamic_full"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_hf_models_train_and_validate_like_unpadded_eager_with_a_smaller_last_batch(family, policy):
    train = hf_stream([6, 11, 19, 27, 40], batch=4) + hf_stream([17], batch=3, seed=9)  # a smaller last batch
    val = hf_stream([9, 23], batch=2, seed=5)  # another batch size
    eager = fit_with_validation(family, train, val)
    # two buckets (the model has 64 positions): each is warmed up for training and validation, every batch size
    fits_the_model = {"shapes": {"pad": {"buckets": [32, 64]}}} if policy == "buckets" else {}
    callback = CompileCallback(policy, backend="aot_eager", telemetry={"measure_flops": False}, **fits_the_model)
    compiled = fit_with_validation(family, train, val, callback)
    torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.stack(compiled.val_losses), torch.stack(eager.val_losses), rtol=1e-4, atol=1e-5)
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)  # the gradients were the same
    events = [e for e in callback.telemetry.compile.events if e.kind == "recompile"]
    if policy.startswith("dynamic"):
        assert events == [], "batch size and length dynamic from the first compile"
    else:  # static graphs per bucket: only the smaller batch's size is new
        assert all("index 0" in e.reason for e in events), [e.reason for e in events]


def test_strict_recompiles_raise_on_a_real_new_shape_of_an_hf_batch_only():
    train = hf_stream([6, 11, 19, 27, 40, 33], batch=4) + hf_stream([17], batch=3, seed=9)
    shapes = {"strict_recompiles": True, "pad": {"buckets": [16, 32, 48, 64]}}
    callback = CompileCallback("buckets", backend="eager", telemetry={"measure_flops": False}, shapes=shapes)
    module = UserModule("gpt2", use_cache=False)
    trainer = quiet_cpu_trainer(max_steps=len(train), limit_val_batches=0, callbacks=[callback])
    with pytest.raises(RecompileError, match=r"would recompile in training after warm-up.*\(3, 32"):
        trainer.fit(module, train_dataloaders=DataLoader(train, batch_size=None))
    assert len(module.losses) == 6, "every batch of 4 rows trained, whatever its length"
