"""Per-block values that need not split blocks sharing one compiled entry (``compiling/block_values.py``): floats as
symbolic graph inputs (moved to entries per value where the compiler specializes them), and a Hugging Face decoder's
KV-cache index (training forwards without a cache; calls with one on an entry of the block's own)."""

import copy

import pytest
import torch
from torch import nn

from compile_trainer import apply_policy, to_policy
from compile_trainer.compiling.regions import ENTRY_PREFIX
from compile_trainer.planning.selection import resolve_plan
from tests.user_models import tiny_llama, token_batches


def timm_drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm.layers.drop.drop_path (timm 1.0.31) as published: its ``bernoulli_`` takes the probability as a float,
    which the compiler bakes into the graph (timm itself cannot be imported beside the CPU torch)."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class TimmDropPath(nn.Module):
    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, True

    def forward(self, x):
        return timm_drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class ScaledBlock(nn.Module):
    """A residual block with a per-layer float: a scale on its branch and, optionally, timm's stochastic depth."""

    def __init__(self, scale: float, drop_prob: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale
        self.drop_path = TimmDropPath(drop_prob) if drop_prob > 0 else nn.Identity()

    def forward(self, x):
        return x + self.drop_path(torch.relu(self.fc(x)) * self.scale)


class Stack(nn.Module):
    def __init__(self, drop_path: bool):
        super().__init__()
        torch.manual_seed(0)
        count = 5
        self.stem = nn.Linear(8, 8)  # the blocks' inputs require gradients, all alike
        self.blocks = nn.Sequential(
            *[ScaledBlock(1 / (i + 1), 0.1 * (i + 1) / count if drop_path else 0.0) for i in range(count)]
        )

    def forward(self, x):
        return self.blocks(self.stem(x)).square().mean()


def train(model: nn.Module, steps: int = 3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    torch.manual_seed(2)  # the stochastic depth's draws
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def block_compiles():
    """(entry name, attempt) of every frame Dynamo compiled through a block's entry."""
    found = []
    for metric in torch._dynamo.utils.get_compilation_metrics():
        if (metric.co_name or "").startswith(ENTRY_PREFIX + "ScaledBlock"):
            found.append((metric.co_name, int(str(metric.compile_id).split("/")[-1])))
    return found


def block_entries(applied) -> set:
    return {item.entry_name for item in applied.compiled if item.region.role == "block"}


def regional(model: nn.Module):
    return apply_policy(model, to_policy("regional", backend="aot_eager"))


def test_blocks_differing_in_a_per_layer_scale_share_one_graph_with_the_scales_as_inputs():
    model = Stack(drop_path=False)
    eager = train(copy.deepcopy(model))
    applied = regional(model)
    assert len(block_entries(applied)) == 1, "five blocks, one entry"
    assert "5 ScaledBlock blocks differ only in the floats scale: one graph" in "\n".join(applied.notes)
    torch.testing.assert_close(train(model), eager)
    compiles = block_compiles()
    assert len(compiles) == 1 and compiles[0][1] == 0, f"one graph, compiled once, never recompiled: {compiles}"


def test_a_float_the_compiler_specializes_moves_the_other_blocks_to_entries_per_value():
    """timm's drop_path: the probability goes into ``bernoulli_`` as a float, so the graph holds its value. The
    first compile shows it; the other blocks move to entries of their own before they run: no recompile."""
    model = Stack(drop_path=True)
    eager = train(copy.deepcopy(model))
    applied = regional(model)
    assert len(block_entries(applied)) == 1
    torch.testing.assert_close(train(model), eager)  # aot_eager draws the same random numbers as eager
    compiles = block_compiles()
    assert [attempt for _, attempt in compiles] == [0] * 5, f"five graphs, none a recompile: {compiles}"
    assert len(block_entries(applied)) == 5 and len({name for name, _ in compiles}) == 5
    note = next(note for note in applied.notes if "the compiler specialized" in note)
    assert "drop_prob" in note and "4 blocks (blocks.1, blocks.2, blocks.3 ...) compile an entry per value" in note


def test_a_float_that_is_zero_in_some_blocks_splits_them():
    """``if p == 0`` takes another branch: zero and non-zero values are two structures, named in the plan."""
    root = nn.Sequential(nn.Sequential(*[ScaledBlock(scale) for scale in (0.0, 0.0, 0.0, 0.5, 0.25, 0.125)]))
    plan = resolve_plan(root, to_policy("regional"))
    blocks = [region for region in plan.regions if region.role == "block"]
    assert len({region.structure for region in blocks}) == 2
    assert [region.shared_floats for region in blocks] == [[]] * 3 + [["scale"]] * 3
    assert "6 ScaledBlock blocks differ in structure (values scale): 2 compiled entries" in "\n".join(plan.notes)


@pytest.fixture
def llama():
    torch.manual_seed(0)
    return tiny_llama()  # the config's defaults: use_cache=True


def test_a_decoder_trains_without_a_kv_cache_and_evaluates_and_generates_with_it(llama):
    batch = token_batches(1, 0)[0]
    reference = copy.deepcopy(llama)
    assert reference(**batch).past_key_values is not None, "transformers builds a cache in training by default"
    applied = regional(llama)
    assert applied.plan.training_without_cache == {"model": "LlamaForCausalLM"}
    output = llama(**batch)
    torch.testing.assert_close(output.loss, reference(**batch).loss)
    assert output.past_key_values is None, "the training forward built no cache"
    assert llama(**batch, use_cache=True).past_key_values is not None, "a call that asks for one gets it"
    llama.eval(), reference.eval()
    with torch.no_grad():
        evaluated, expected = llama(**batch), reference(**batch)
    assert (
        evaluated.past_key_values is not None
        and evaluated.past_key_values.get_seq_length() == batch["input_ids"].shape[1]
    )
    torch.testing.assert_close(evaluated.logits, expected.logits)
    prompt = batch["input_ids"][:1, :6]
    generated = llama.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=3, do_sample=False))
    cached = [item.cache_entry for item in applied.compiled if item.region.role == "block"]
    assert all(entry is not None for entry in cached) and len({entry.__name__ for entry in cached}) == 4
    llama.train()
    applied.remove()
    assert llama(**batch).past_key_values is not None, "remove() takes the hook away"
