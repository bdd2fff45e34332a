"""The ``shapes`` section without Lightning: validation, batch traversal, padding, marking, collate."""

import collections
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics
from torch.utils.data import DataLoader

from compile_trainer import PolicyError, apply_policy, to_policy
from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.schema.shapes import ShapesPolicy, bucket_lengths
from compile_trainer.shapes.batch import BatchShaper, PadCollate, ShapeError
from compile_trainer.shapes.region_inputs import RegionShapeInterceptors
from compile_trainer_recipes.data import PadToLongest, Paragraphs, TokenBatch
from compile_trainer_recipes.gpt import GPT
from tests.conftest import TINY_GPT, Wrapper

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()
RULES = [{"name": "*", "action": "regional", "rest": "compile"}]


def shapes(**section) -> ShapesPolicy:
    return to_policy({"rules": RULES, "shapes": section}).shapes


PAD = {"buckets": [8, 16, 24, 32], "values": {"inputs": 0, "targets": -100}}


@pytest.mark.parametrize(
    "section, message",
    [
        ({"pad": {**PAD, "buckets": [16, 8, 32]}}, r"buckets must be sorted ascending.*\[16, 8, 32\]"),
        ({"pad": {**PAD, "buckets": [0, 8]}}, "buckets must be positive"),
        ({"pad": {**PAD, "buckets": [8, 8]}}, "without repeats"),
        ({"pad": {**PAD, "multiple_of": 8}}, "powers_of_two, auto, not buckets and multiple_of"),
        ({"pad": {"values": {"inputs": 0}}}, "values are given but no buckets"),
        ({"pad": {**PAD, "buckets": [], "powers_of_two": {"min": 12, "max": 64}}}, "powers of two"),
        ({"pad": {**PAD, "values": {"inputs": 0, "targets": None}}}, "missing pad value for entry 'targets'"),
        ({"pad": {**PAD, "values": {}}}, "values is empty"),
        ({"pad": {**PAD, "overflow": "wrap"}}, "overflow 'wrap' is invalid; valid: error, truncate"),
        (
            {"pad": PAD, "dynamic": [{"entry": "inputs", "dim": 1, "min": 12}]},
            "bucket 8 is smaller than min 12",
        ),
        ({"dynamic": [{"entry": "inputs", "dim": 1, "min": 1}]}, "min must be >= 2.*specializes sizes 0 and 1"),
        ({"dynamic": [{"entry": "inputs", "dim": 1, "min": 8, "max": 4}]}, r"max \(4\) is smaller than min \(8\)"),
        ({"dynamic": [{"dim": 1}]}, "give `entry`"),
        ({"strict_recompiles": True}, "strict_recompiles needs shapes.warmup"),
        ({"warmup": True, "pad": {**PAD, "buckets": [], "multiple_of": 8}}, "warmup needs a finite set of buckets"),
        ({"dynamic": [{"entry": "inputs", "dim": 1}], "pad": {**PAD, "bogus": 1}}, "bogus"),
    ],
)
def test_bad_shape_sections_fail_with_what_is_valid(section, message):
    with pytest.raises(PolicyError, match=message):
        to_policy({"rules": RULES, "shapes": section})


def test_policy_level_conflicts_are_errors():
    with pytest.raises(PolicyError, match="dynamic: false.*ignore the marks"):
        to_policy({"rules": RULES, "dynamic": False, "shapes": {"dynamic": [{"entry": "inputs", "dim": 1}]}})
    with pytest.raises(PolicyError, match="dynamic: false.*ignore the marks"):
        rules = [{"name": "*", "action": "full", "dynamic": False}]
        to_policy({"rules": rules, "shapes": {"dynamic": [{"entry": "inputs", "dim": 1}]}})
    with pytest.raises(PolicyError, match="10 buckets compile 10 static graphs.*recompile_limit \\(8\\)"):
        to_policy({"rules": RULES, "dynamic": False, "shapes": {"pad": {**PAD, "buckets": list(range(1, 11))}}})


def test_bucket_rules():
    assert bucket_lengths(shapes(pad={**PAD, "buckets": [], "powers_of_two": {"min": 16, "max": 128}}).pad) == [
        16,
        32,
        64,
        128,
    ]
    multiples = shapes(pad={**PAD, "buckets": [], "multiple_of": 8, "max": 32})
    assert bucket_lengths(multiples.pad) == [8, 16, 24, 32]
    unbounded = BatchShaper(shapes(pad={**PAD, "buckets": [], "multiple_of": 8}))
    assert unbounded.buckets is None and unbounded.bucket_for(1001) == 1008
    shaper = BatchShaper(shapes(pad=PAD))
    assert [shaper.bucket_for(n) for n in (1, 8, 9, 24, 25, 32, 33)] == [8, 8, 16, 24, 32, 32, None]


@dataclass
class Features:
    ids: torch.Tensor
    mask: torch.Tensor


def test_padding_keeps_container_types_and_uses_each_entrys_value():
    shaper = BatchShaper(shapes(pad={"buckets": [8, 16], "values": {"features.ids": 3, "features.mask": False}}))
    batch = {"features": Features(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)), "n": 2}
    padded = shaper.pad(batch)
    assert isinstance(padded, dict) and isinstance(padded["features"], Features) and padded["n"] == 2
    assert padded["features"].ids.shape == (2, 8) and padded["features"].ids[0].tolist() == [1] * 5 + [3] * 3
    assert padded["features"].mask.dtype == torch.bool and padded["features"].mask[:, 5:].sum() == 0
    assert batch["features"].ids.shape == (2, 5), "the input batch is left as it was"

    tuple_shaper = BatchShaper(shapes(pad={"buckets": [8], "values": {"0": 0, "1": -100}}))
    padded = tuple_shaper.pad((torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long)))
    assert isinstance(padded, tuple) and padded[1][0].tolist() == [1, 1, 1] + [-100] * 5
    named = BatchShaper(shapes(pad=PAD)).pad(TokenBatch(torch.ones(2, 9), torch.ones(2, 9)))
    assert isinstance(named, TokenBatch) and named.inputs.shape == (2, 16)


def test_bad_batches_name_the_entries_and_shapes_seen():
    batch = TokenBatch(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"no entry 'input_ids'; entries seen: inputs: \(2, 5\) int64, targets"):
        BatchShaper(shapes(pad={**PAD, "values": {"input_ids": 0}})).pad(batch)
    with pytest.raises(ShapeError, match=r"'inputs' has shape \(2, 5\): dim 2 does not exist"):
        BatchShaper(shapes(dynamic=[{"entry": "inputs", "dim": 2}])).mark(batch)
    with pytest.raises(ShapeError, match="'targets' .* has the padded length 5 at dim 1 but no pad value"):
        BatchShaper(shapes(pad={**PAD, "values": {"inputs": 0}})).pad(batch)
    with pytest.raises(ShapeError, match=r"size 5 at dim 1, outside the range \[8, None\]"):
        BatchShaper(shapes(dynamic=[{"entry": "inputs", "dim": 1, "min": 8}])).mark(batch)
    with pytest.raises(ShapeError, match="does not fit its dtype"):
        BatchShaper(shapes(pad={**PAD, "values": {"inputs": 0.5, "targets": -100}})).pad(batch)


def test_overflow_is_an_error_or_a_declared_truncation():
    long_batch = TokenBatch(torch.arange(40).expand(2, 40), torch.arange(40).expand(2, 40))
    with pytest.raises(ShapeError, match="length 40 at dim 1, longer than the largest bucket 32.*overflow: truncate"):
        BatchShaper(shapes(pad=PAD)).pad(long_batch)
    cut = BatchShaper(shapes(pad={**PAD, "overflow": "truncate"})).pad(long_batch)
    assert cut.inputs.shape == (2, 32) and torch.equal(cut.targets[0], torch.arange(32))


def test_marks_skip_sizes_0_and_1_and_reach_region_inputs_with_the_same_sizes():
    shaper = BatchShaper(shapes(dynamic=[{"entry": "inputs", "dim": 0}, {"entry": "inputs", "dim": 1}]))
    batch = shaper.mark(TokenBatch(torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 7)))
    assert batch.inputs._dynamo_dynamic_indices == {0, 1}
    hidden, mask, other = torch.zeros(4, 7, 16), torch.zeros(4, 1, 7, 7), torch.zeros(3, 4, 16)
    position_ids, rotary = torch.arange(7)[None], (torch.zeros(1, 7, 8), torch.zeros(1, 7, 8))
    inputs = {"mask": mask, "other": other, "position_ids": position_ids, "position_embeddings": rotary}
    shaper.mark_region_inputs((hidden,), inputs, "block")
    assert hidden._dynamo_weak_dynamic_indices == {0, 1}, "same sizes at the same dims: marked"
    assert mask._dynamo_weak_dynamic_indices == {0, 2, 3}, "a length wherever it stands, the batch size at dim 0"
    assert not hasattr(other, "_dynamo_weak_dynamic_indices"), "the batch size (4) at another dim left alone"
    assert position_ids._dynamo_weak_dynamic_indices == {1}, "derived from the batch: its length dim, not the 1"
    assert all(t._dynamo_weak_dynamic_indices == {1} for t in rotary), "tensors nested in a tuple too"
    # the next batch's length equals the hidden size: the region's inputs keep the dims of its first call
    batch = shaper.mark(TokenBatch(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16)))  # in use, as in a step
    hidden = torch.zeros(4, 16, 16)
    shaper.mark_region_inputs((hidden,), {}, "block")
    assert hidden._dynamo_weak_dynamic_indices == {0, 1}, "a dim marked only where the first call marked it"
    single = shaper.mark(TokenBatch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1)))
    assert not hasattr(single.inputs, "_dynamo_dynamic_indices") and shaper.dynamic_sizes == set()


def test_padding_changes_neither_loss_nor_gradients():
    """Padded targets are ``ignore_index`` and attention is causal: real positions see the same inputs."""
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    samples = [TokenBatch(t[:-1], t[1:]) for t in (torch.randint(1, 64, (n,)) for n in (6, 9, 13))]
    batch = PadToLongest(pad_token_id=0, ignore_index=-100)(samples)  # padded to the longest: 12
    bucketed = BatchShaper(shapes(pad={"buckets": [16], "values": {"inputs": 0, "targets": -100}})).pad(batch)
    assert bucketed.inputs.shape == (3, 16)

    def loss_and_grads(b):
        model.zero_grad()
        _, loss = model(*b)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def per_sample(sample):
        model.zero_grad()
        _, loss = model(sample.inputs[None], sample.targets[None])
        return loss.detach() * len(sample.targets)

    loss, grads = loss_and_grads(batch)
    padded_loss, padded_grads = loss_and_grads(bucketed)
    assert torch.allclose(loss, padded_loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, padded_grads))
    unpadded = sum(per_sample(s) for s in samples) / sum(len(s.targets) for s in samples)
    assert torch.allclose(loss, unpadded, atol=1e-5), "and both equal the loss of the samples unpadded"


def test_padded_batches_through_compiled_regions_match_eager():
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    batch = TokenBatch(torch.randint(1, 64, (2, 11)), torch.randint(0, 64, (2, 11)))
    eager_loss = model(*batch)[1]
    apply_policy(Wrapper(model), to_policy("buckets", backend="aot_eager", shapes={"pad": {"buckets": [16]}}))
    padded = BatchShaper(to_policy("buckets", shapes={"pad": {"buckets": [16]}}).shapes).pad(batch)
    assert torch.allclose(model(*padded)[1], eager_loss, atol=1e-5)


def test_dynamic_regions_compile_once_and_match_eager_losses_and_gradients():
    """Outside Lightning: ``BatchShaper`` marks the batch, ``RegionShapeInterceptors`` the regions' inputs."""
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    batches = [TokenBatch(torch.randint(1, 64, (3, n)), torch.randint(0, 64, (3, n))) for n in (5, 9, 14)]

    def losses_and_grads():
        results = []
        for batch in batches:
            model.zero_grad()
            loss = model(*shaper(batch))[1]
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        return results

    shaper = BatchShaper(ShapesPolicy())
    eager = losses_and_grads()
    policy = to_policy("dynamic", backend="aot_eager")
    applied = apply_policy(Wrapper(model), policy)
    shaper = BatchShaper(policy.shapes)
    RegionShapeInterceptors(applied, shaper)
    clear_compilation_metrics()
    compiled = losses_and_grads()
    for (loss, grads), (compiled_loss, compiled_grads) in zip(eager, compiled):
        assert torch.allclose(loss, compiled_loss, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, compiled_grads))
    frames = collections.Counter(m.co_name for m in get_compilation_metrics())
    block = next(c.entry_name for c in applied.compiled if c.region.name == "model.blocks.0")
    assert frames[block] == 1, "the blocks compiled dynamic at the first length"


def test_pad_collate_pads_on_the_host_in_a_dataloader():
    texts = [b"def f():\n    return 1\n\n\nclass A:\n    x = 1\n    y = 2\n\nimport os\n"]
    dataset = Paragraphs(texts, block_size=32, min_length=4)
    assert dataset.lengths() == [20, 27, 8], "one paragraph per sample, less the first byte"
    collate = PadCollate(shapes(pad=PAD), PadToLongest(0, -100))
    batches = list(DataLoader(dataset, batch_size=2, collate_fn=collate))
    assert [b.inputs.shape for b in batches] == [(2, 32), (1, 8)]
    assert (batches[0].targets[0] == -100).sum() == 32 - 20 and (batches[0].inputs[0, 20:] == 0).all()


def test_bundled_buckets_and_dynamic_policies_leave_the_recipe_to_the_user():
    """A policy file picks no recipe (another project's Hydra config could not compose one that did)."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        buckets = compose("config", overrides=["compile=buckets", "recipe=gpt_tiny_varlen"])
        regional_then_buckets = compose("config", overrides=["compile=[regional,buckets]"])
        own_recipe = compose("config", overrides=["compile=dynamic"])
    assert buckets.recipe.name == "gpt_tiny_varlen" and buckets.recipe.data.val_batch_size == 8
    policy = to_policy(OmegaConf.to_container(buckets.compile, resolve=True))
    assert policy.dynamic is False and policy.shapes.pad.buckets == [32, 64, 96, 128] and policy.shapes.warmup
    assert policy.rules[0].action == "regional"
    assert to_policy(OmegaConf.to_container(regional_then_buckets.compile, resolve=True)) == policy
    assert own_recipe.recipe.name == "gpt_tiny", "the config's default recipe"
    assert [d.dim for d in to_policy("dynamic").shapes.dynamic] == [0, 1] * 5
