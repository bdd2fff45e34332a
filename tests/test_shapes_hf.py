"""The bundled ``dynamic`` and ``buckets`` policies on Hugging Face batches (``input_ids``, ``attention_mask``,
``labels``), as they come: entries found by role, zero recompiles over a stream of new lengths."""

import pytest
import torch
from torch._dynamo.utils import get_compilation_metrics
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, ShapeError, to_policy
from compile_trainer.shapes.batch import BatchShaper
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


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_dynamic_never_recompiles_on_a_stream_of_new_lengths(family):
    _, callback = fit_stream(family, "dynamic", hf_stream())
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


def test_buckets_pad_hf_batches_by_role_without_changing_training_and_compile_only_in_warm_up():
    stream = hf_stream(list(range(6, 60, 3)))  # lengths in 3 of the 4 bundled buckets (32, 64, 96, 128)
    module, callback = fit_stream("llama", "buckets", stream)
    assert callback.summary()["recompiles"] == 0, callback.telemetry.compile.events
    assert callback.shape_hooks is None, "the batch hooks are removed at teardown"
    eager = UserModule("llama", use_cache=False)
    quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0).fit(
        eager, train_dataloaders=DataLoader(stream, batch_size=None)
    )
    # Warm-up runs training_step once per bucket (4) before the first real step, as docs/dynamic_shapes.md says:
    # a training_step that records its losses sees those calls first.
    buckets = callback.policy.shapes.pad.buckets
    assert len(module.losses) == len(buckets) + len(stream)
    # padded to buckets (ids and mask 0, labels -100) and compiled, training is the unpadded eager training
    trained = torch.stack(module.losses[len(buckets) :])
    torch.testing.assert_close(trained, torch.stack(eager.losses), rtol=1e-4, atol=1e-5)
    padded = BatchShaper(callback.policy.shapes).pad(stream[0])
    assert padded["input_ids"].shape[1] == 32 and (padded["labels"][:, 6:] == -100).all()
