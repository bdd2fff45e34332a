"""Per-block values that need not split blocks sharing one compiled entry (``compiling/block_values.py``): floats as
symbolic graph inputs, and a Hugging Face decoder's KV-cache index (training forwards without a cache; calls with one
on an entry of the block's own). A value the compiler specializes anyway (timm's drop_path, GPT-2's per-layer
attention scale) gives an entry per value: found by a trial trace before the plan is printed, or else at the first
compile, before the other blocks run."""

import copy
import logging

import pytest
import torch
from torch import nn

from compile_trainer import apply_policy, compat, format_plan_table, to_policy
from compile_trainer.compiling.block_values import KEEP_BUFFER, share_stochastic_depth
from compile_trainer.compiling.regions import ENTRY_PREFIX
from compile_trainer.planning.selection import resolve_plan
from tests.user_models import TimmDropPath, TimmViT, image_batches, tiny_gpt2, tiny_llama, token_batches


class SampleGate(nn.Module):
    """timm's drop_path under a name the library does not know as stochastic depth: it hands its per-block
    probability to ``bernoulli_``, so the compiler specializes the float."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)


class ScaledBlock(nn.Module):
    """A residual block with a per-layer float: a scale on its branch and, optionally, a sample gate."""

    def __init__(self, scale: float, drop_prob: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale
        self.drop_path = SampleGate(drop_prob) if drop_prob > 0 else nn.Identity()

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


# Before torch 2.13 Dynamo specializes a float attribute of a module however the entry is primed: there the trial
# trace finds it, and the plan splits the blocks by value before training (docs/regional.md).
FLOATS_SHARED = compat.torch_version() >= (2, 13)
SPECIALIZED = "which the compiler specializes (a trial trace of one block before training guards on"


def test_blocks_differing_in_a_per_layer_scale_share_one_graph_with_the_scales_as_inputs():
    model = Stack(drop_path=False)
    eager = train(copy.deepcopy(model))
    applied = regional(model)
    notes = "\n".join(applied.notes)
    if not FLOATS_SHARED:
        assert f"5 ScaledBlock blocks differ in scale, {SPECIALIZED} scale" in notes, notes
        assert not block_entries(applied), "five values, too little reuse: compiled whole"
        torch.testing.assert_close(train(model), eager)
        return
    assert len(block_entries(applied)) == 1, "five blocks, one entry"
    assert "5 ScaledBlock blocks differ only in the floats scale: one graph" in notes
    torch.testing.assert_close(train(model), eager)
    compiles = block_compiles()
    assert len(compiles) == 1 and compiles[0][1] == 0, f"one graph, compiled once, never recompiled: {compiles}"


def entry_compiles():
    """(entry name, attempt) of every frame Dynamo compiled through a region's entry (trial traces are not)."""
    found = []
    for metric in torch._dynamo.utils.get_compilation_metrics():
        if (metric.co_name or "").startswith(ENTRY_PREFIX):
            found.append((metric.co_name, int(str(metric.compile_id).split("/")[-1])))
    return found


def assert_ran_as_planned(applied, table: str):
    """The plan printed before training is what ran: the same table and notes after it, every planned entry compiled
    once (no recompile), and no other entry."""
    assert format_plan_table(applied) == table, "the plan changed while training"
    compiles = entry_compiles()
    assert [attempt for _, attempt in compiles] == [0] * len(compiles), f"a recompile: {compiles}"
    assert sorted(name for name, _ in compiles) == sorted(applied.shared_counts()), compiles


def test_a_float_the_compiler_specializes_splits_the_blocks_in_the_plan_which_then_compiles_the_stack_whole():
    """A gate that hands its probability to ``bernoulli_`` (as timm's drop_path does), whose float the graph holds.
    A trial trace of one block shows it before the plan is printed: one entry per value, so five structures for five
    blocks, too little reuse to compile them apart (regional_min_reuse): the model is compiled whole, and the run is
    what was printed."""
    model = Stack(drop_path=True)
    eager = train(copy.deepcopy(model))
    applied = regional(model)
    table = format_plan_table(applied)
    assert [(item.region.name, item.region.role) for item in applied.compiled] == [("stem", "full"), ("blocks", "full")]
    specialized = "drop_path.drop_prob" if FLOATS_SHARED else "scale, drop_path.drop_prob"
    assert f"5 ScaledBlock blocks differ in {specialized}, {SPECIALIZED}" in table, "the scale stays a graph input"
    assert "blocks (Sequential): 5 blocks in 5 structures (1.0 per graph), below regional_min_reuse 3" in table
    torch.testing.assert_close(train(model), eager)  # aot_eager draws the same random numbers as eager
    assert_ran_as_planned(applied, table)


def test_blocks_kept_regional_get_an_entry_per_specialized_value_from_the_start():
    model = Stack(drop_path=True)
    eager = train(copy.deepcopy(model))
    applied = apply_policy(model, to_policy("regional", backend="aot_eager", regional_min_reuse=0))
    table = format_plan_table(applied)
    assert len(block_entries(applied)) == 5 and "6 regions, 6 compiled entries" in table
    torch.testing.assert_close(train(model), eager)
    assert_ran_as_planned(applied, table)
    assert not any("the compiler specialized" in note for note in applied.notes), "nothing was left to the run"


class TwoInputBlock(nn.Module):
    """A block no trial trace can call (it takes a gate besides its input) that reads a per-block float the compiler
    specializes (a sample gate) or an index in its training computation (as GPT-2 of transformers 4.x does)."""

    def __init__(self, index: int, reads_index: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.layer_idx, self.reads_index = index, reads_index
        self.drop_path = nn.Identity() if reads_index else SampleGate(0.05 * (index + 1))

    def forward(self, x, gate):
        out = torch.relu(self.fc(x)) * gate
        return x + self.drop_path(out / float(self.layer_idx + 1) if self.reads_index else out)


class GatedStack(nn.Module):
    def __init__(self, reads_index: bool):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([TwoInputBlock(i, reads_index) for i in range(4)])
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, self.gate)
        return x.square().mean()


@pytest.mark.parametrize("value", ["float", "index"])
def test_without_a_trial_trace_the_first_compile_moves_the_other_blocks_before_they_run(value):
    model = GatedStack(reads_index=value == "index")
    eager = train(copy.deepcopy(model))
    applied = apply_policy(model, to_policy("regional", backend="aot_eager", regional_min_reuse=0))
    attribute = "layer_idx" if value == "index" else "drop_prob"
    assert len(block_entries(applied)) == 1, "the plan could not see it: the blocks share one entry"
    untried = next(note for note in applied.notes if "4 TwoInputBlock blocks differ in " in note)
    assert attribute in untried.split(":")[0], "the note names what is left to the run"
    assert "whether the compiler specializes them shows at their first compile" in untried, untried
    assert "(no trial trace of one block before training: called with one tensor of shape (2, 4, 8): " in untried
    assert " at " in untried, "the line the trial's call stopped at"
    torch.testing.assert_close(train(model), eager)
    compiles = entry_compiles()
    assert [attempt for _, attempt in compiles] == [0] * len(compiles), f"a recompile: {compiles}"
    assert len(block_entries(applied)) == 4, "an entry per value, chosen at the first compile"
    note = next(note for note in applied.notes if "the compiler specialized" in note)
    assert attribute in note and "3 blocks (blocks.1, blocks.2, blocks.3) compile an entry per value" in note


class GatedBlock(nn.Module):
    """A block no trial trace can call (it takes a gate besides its input) with a sample gate of its own."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop_path = SampleGate(drop_prob)

    def forward(self, x, gate):
        return x + self.drop_path(torch.relu(self.fc(x)) * gate)


class SplitStage(nn.Module):
    """Two stages of gated blocks, one probability in the second block and another in the three others: the first
    compile (the second block's; the first block's call checks its bf16 input eagerly) moves the three to an entry
    of their value. Under autocast the stem and the projection hand the first and third blocks bf16, the others
    fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.project = nn.Linear(8, 8), nn.Linear(8, 8)
        self.blocks = nn.ModuleList([GatedBlock(p) for p in (0.05, 0.1, 0.05, 0.05)])
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](self.stem(x), self.gate), self.gate)
        x = self.blocks[3](self.blocks[2](self.project(x), self.gate), self.gate)
        return x.square().mean()


def test_blocks_moved_to_an_entry_of_their_own_value_still_share_its_graph_across_input_dtypes():
    model = SplitStage()
    applied = apply_policy(model, to_policy("regional", backend="aot_eager", regional_min_reuse=0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(model)
    assert len(block_entries(applied)) == 2, "blocks.0, 2 and 3 moved together to the entry of their value"
    compiles = entry_compiles()
    assert [attempt for _, attempt in compiles] == [0] * len(compiles), f"a recompile: {compiles}"
    moved = [note for note in applied.notes if "the blocks sharing its graph: bfloat16" in note]
    assert [note.split(" and ")[0] for note in moved] == ["blocks.0", "blocks.2"], "each entry upcasts its inputs"


GPT2_ATTENTION = {
    # transformers 5.x: the layer's factor folded into attn.scaling, a float scaled_dot_product_attention specializes
    "transformers_5": ({}, "attn.scaling"),
    # transformers 4.x: attn_weights / float(self.layer_idx + 1) in every forward
    "transformers_4": ({"attn_implementation": "gpt2_of_transformers_4"}, "attn.layer_idx"),
}


@pytest.mark.parametrize("use_cache", [False, None], ids=["use_cache_false", "config_default"])
@pytest.mark.parametrize("attention", GPT2_ATTENTION)
def test_gpt2_scaling_attention_by_inverse_layer_index_trains_as_planned_without_recompiles(attention, use_cache):
    """GPT-2 with ``scale_attn_by_inverse_layer_idx``: each layer's attention scale differs, and the compiler
    specializes it, whether as a float or as the index it is computed from. The plan says so before training and
    compiles the three layers (three structures) with the model around them."""
    config, path = GPT2_ATTENTION[attention]
    cache = {} if use_cache is None else {"use_cache": use_cache}
    torch.manual_seed(0)
    model = tiny_gpt2(scale_attn_by_inverse_layer_idx=True, **config, **cache)
    eager = train_lm(copy.deepcopy(model))
    applied = regional(model)
    table = format_plan_table(applied)
    assert f"3 GPT2Block blocks differ in {path}, which the compiler specializes" in table
    assert "transformer (GPT2Model): 3 blocks in 3 structures (1.0 per graph)" in table and "compiled whole" in table
    assert "only to address a KV cache" not in table, "compiled whole: its training forwards keep the config's cache"
    torch.testing.assert_close(train_lm(model), eager)
    assert_ran_as_planned(applied, table)


def test_gpt2_with_its_layers_kept_regional_runs_an_entry_per_layer_without_recompiles():
    torch.manual_seed(0)
    model = tiny_gpt2(scale_attn_by_inverse_layer_idx=True, attn_implementation="gpt2_of_transformers_4")
    eager = train_lm(copy.deepcopy(model))
    applied = apply_policy(model, to_policy("regional", backend="aot_eager", regional_min_reuse=0))
    table = format_plan_table(applied)
    assert len(block_entries(applied)) == 3
    torch.testing.assert_close(train_lm(model), eager)
    assert_ran_as_planned(applied, table)


def train_lm(model: nn.Module) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in token_batches(3, 0):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


class ViTClassifier(nn.Module):
    def __init__(self, **config):
        super().__init__()
        torch.manual_seed(0)
        self.model = TimmViT(**config)

    def forward(self, pixel_values, labels):
        return nn.functional.cross_entropy(self.model(pixel_values), labels)


def test_a_timm_vit_with_stochastic_depth_shares_one_graph_across_its_probabilities():
    """timm's ViT recipe (drop_path_rate 0.1, rising linearly over the blocks): block 0 has no drop path, the others
    one probability each, which timm's drop_path would specialize. Compiled, the drop paths read their probability
    from a tensor: two entries (block 0, the rest), compiled once each, state_dict keys unchanged. The compiled
    draws are not eager's, so the outputs are compared with drop path off (evaluation)."""
    model = ViTClassifier(depth=6, drop_path_rate=0.1)
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    applied = regional(model)
    table = format_plan_table(applied)
    assert (
        "5 TimmBlock blocks (model.blocks.1, model.blocks.2, model.blocks.3 and 2 more) differ only in the floats "
        "drop_path1.drop_prob, drop_path2.drop_prob: one graph" in table
    )
    assert len(block_entries(applied)) == 2 and "which the compiler specializes" not in table
    for batch in image_batches(3, 0):
        model(**batch).backward()
    assert_ran_as_planned(applied, table)
    assert list(model.state_dict()) == keys
    model.eval()
    reference.eval()
    batch = image_batches(1, 1)[0]
    torch.testing.assert_close(model(**batch), reference(**batch))


def test_compiled_stochastic_depth_keeps_samples_at_its_rate_and_scale_and_eager_is_unchanged():
    module = nn.Sequential(nn.Linear(4, 4), TimmDropPath(0.3)).train()
    shared = share_stochastic_depth(module, ["1.drop_prob"])
    x = torch.ones(20000, 1, 4)
    out = torch.compile(module[1], backend="aot_eager", fullgraph=True)(x)
    kept = out[:, 0, 0]
    assert torch.all((kept == 0) | torch.isclose(kept, torch.tensor(1 / 0.7))), kept.unique()
    assert abs((kept > 0).float().mean().item() - 0.7) < 0.02
    torch.manual_seed(3)
    eager = module[1](x)
    torch.manual_seed(3)
    assert torch.equal(eager, type(module[1]).forward(module[1], x)), "outside a compile, timm's own forward runs"
    assert [name for name, _ in module.named_buffers()] == [f"1.{KEEP_BUFFER}"], "a buffer while shared"
    assert list(module.state_dict()) == ["0.weight", "0.bias"], "not persistent: checkpoints are unchanged"
    shared.undo()
    assert "forward" not in vars(module[1]) and not list(module.named_buffers())


@pytest.mark.parametrize("probability", [0.0, 1.0])
def test_a_drop_path_rate_changed_after_the_policy_is_applied_reaches_the_compiled_forward(probability):
    """A drop-path schedule sets the modules' probabilities between steps. The compiled forward reads them from
    buffers, refilled before each region call: set to 0 (no sample dropped) or 1 (every residual branch dropped,
    as timm's own does), training outputs equal eager ones, with no recompile."""
    model = ViTClassifier(depth=6, drop_path_rate=0.1)
    reference = copy.deepcopy(model)
    applied = regional(model)
    batch = image_batches(1, 0)[0]
    model(**batch).backward()  # compiled at the policy's rates
    for module in [*model.modules(), *reference.modules()]:
        if isinstance(module, TimmDropPath):
            module.drop_prob = probability
    torch.testing.assert_close(model(**batch), reference(**batch))
    assert len(block_entries(applied)) == 2
    compiles = entry_compiles()
    assert compiles and [attempt for _, attempt in compiles] == [0] * len(compiles), f"a recompile: {compiles}"


def test_a_float_that_is_zero_in_some_blocks_splits_them():
    """``if p == 0`` takes another branch: zero and non-zero values are two structures, named in the plan."""
    root = nn.Sequential(nn.Sequential(*[ScaledBlock(scale) for scale in (0.0, 0.0, 0.0, 0.5, 0.25, 0.125)]))
    plan = resolve_plan(root, to_policy("regional"))
    blocks = [region for region in plan.regions if region.role == "block"]
    assert len({region.structure for region in blocks}) == 2
    assert [region.shared_floats for region in blocks] == [[]] * 3 + [["scale"]] * 3
    notes = "\n".join(plan.notes)
    assert "3 ScaledBlock blocks (0.3, 0.4, 0.5) differ only in the floats scale: one graph" in notes
    assert "6 ScaledBlock blocks differ in structure (values scale): 2 compiled entries" in notes


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


LOGGER = logging.getLogger("tests.warns_once")


class WarnsOnceBlock(ScaledBlock):
    """Calls Hugging Face's ``logger.warning_once`` (as its attention does when asked for weights it cannot give)."""

    def forward(self, x):
        LOGGER.warning_once("attention weights are not returned")
        return super().forward(x)


def test_a_block_that_warns_once_is_traced_by_the_trial_as_its_region_compiles_it():
    assert hasattr(logging.Logger, "warning_once"), "transformers adds it when imported"
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[WarnsOnceBlock(1 / (i + 1)) for i in range(4)]))
    applied = regional(model)
    notes = "\n".join(applied.notes)
    assert "no trial trace" not in notes, notes
    if not FLOATS_SHARED:  # the trial ran: it found the specialized scale
        assert f"4 WarnsOnceBlock blocks differ in scale, {SPECIALIZED} scale" in notes, notes
        return
    assert "4 WarnsOnceBlock blocks differ only in the floats scale: one graph" in notes, notes
