"""``rest: auto`` (the bundled ``regional`` policy's): ``outer`` where a module's weights outside its blocks reach
``regional_outer_min_share``, else ``eager``; ``compile`` where none of those weights is in the code around the
break. Plans only: nothing is compiled."""

import pytest
import transformers
from torch import nn

from compile_trainer.planning.selection import resolve_plan
from compile_trainer.schema import PolicyError, to_policy
from tests.conftest import Wrapper


def big_vocab_llama() -> nn.Module:
    """A decoder LM whose embeddings and head outweigh its blocks, as a 32k-vocab Llama's are a large share."""
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def small_head_vit() -> nn.Module:
    """A classifier whose blocks hold nearly everything (patch embedding, 10-class head), as ViT-B/16's do."""
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, num_labels=10,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def share_outside(model: nn.Module, stack: nn.Module) -> float:
    def elements(module):
        return sum(t.numel() for t in [*module.parameters(), *module.buffers()])

    return 1 - elements(stack) / elements(model)


def regional_plan(model: nn.Module, **overrides):
    return resolve_plan(nn.ModuleDict({"model": model}), to_policy("regional", **overrides))


def roles(plan):
    return {region.name: region.role for region in plan.regions}


def notes(plan) -> str:
    return "\n".join(plan.notes)


def test_a_decoder_lm_with_a_large_vocab_is_compiled_around_its_blocks():
    model = big_vocab_llama()
    share = share_outside(model, model.model.layers)
    assert share > 0.5
    plan = regional_plan(model)
    assert roles(plan)["model"] == "outer"
    assert plan.regions[0].breaks == ["model.model"], "the module that loops over the layers runs eagerly"
    assert list(roles(plan).values()).count("block") == 4
    note = f"model (LlamaForCausalLM): {share:.1%} of its parameters and buffers outside its 4 blocks"
    assert f"{note} (>= regional_outer_min_share 10%): compiled whole around its blocks (rest: outer)" in notes(plan)


class SlicingWrapper(nn.Module):
    """A training wrapper that holds no weights of its own: it slices a batch for a model that does the rest."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens[:, :-1], tokens[:, 1:])


def test_a_wrapper_without_weights_around_the_blocks_compiles_the_parts_with_weights_instead(tiny_gpt):
    """The recipe's GPT loops over its blocks itself, so the break is the whole GPT: an outer region would compile
    the wrapper's slicing only."""
    wrapper = SlicingWrapper(tiny_gpt)
    plan = regional_plan(wrapper)
    assert roles(plan) == {
        "model.model.embed": "rest",
        **{f"model.model.blocks.{i}": "block" for i in range(3)},
        "model.model.head": "rest",
    }
    share = share_outside(wrapper, tiny_gpt.blocks)
    assert (
        f"model (SlicingWrapper): {share:.1%} of its parameters and buffers outside its 3 blocks (>= "
        "regional_outer_min_share 10%), all of them in model.model, which runs eagerly around the blocks: its parts "
        "compiled as regions (rest: compile)"
    ) in notes(plan)
    # an HF causal LM in the same wrapper: its head (and loss) is code around the break, so it is compiled whole
    llama = regional_plan(SlicingWrapper(big_vocab_llama()))
    assert roles(llama)["model"] == "outer" and llama.regions[0].breaks == ["model.model.model"]


def test_a_vit_with_a_small_head_compiles_its_blocks_only():
    model = small_head_vit()
    share = share_outside(model, model.vit.layers)
    assert share < 0.05
    plan = regional_plan(model)
    assert roles(plan) == {f"model.vit.layers.{i}": "block" for i in range(4)}
    note = f"model (ViTForImageClassification): {share:.1%} of its parameters and buffers outside its 4 blocks"
    assert f"{note} (< regional_outer_min_share 10%): the code around them left eager" in notes(plan)
    assert "(rest: eager)" in notes(plan)


@pytest.mark.parametrize("build, threshold, road", [(small_head_vit, 0.02, "outer"), (big_vocab_llama, 0.9, "eager")])
def test_the_threshold_flips_the_road(build, threshold, road):
    plan = regional_plan(build(), regional_outer_min_share=threshold)
    assert (roles(plan).get("model") == "outer") == (road == "outer")
    assert f"regional_outer_min_share {threshold * 100:g}%)" in notes(plan) and f"(rest: {road})" in notes(plan)


def test_an_explicit_rest_keeps_its_meaning_whatever_the_share():
    rule = {"name": "*", "action": "regional"}
    outer = regional_plan(small_head_vit(), rules=[{**rule, "rest": "outer"}])
    assert roles(outer)["model"] == "outer" and "regional_outer_min_share" not in notes(outer)
    split = regional_plan(big_vocab_llama(), rules=[{**rule, "rest": "compile"}])
    assert "model" not in roles(split) and roles(split)["model.lm_head"] == "rest"


def test_auto_falls_back_to_compile_where_the_module_loops_over_its_blocks(tiny_gpt):
    plan = resolve_plan(Wrapper(tiny_gpt), to_policy("regional"))
    assert roles(plan) == {
        "model.embed": "rest",
        **{f"model.blocks.{i}": "block" for i in range(3)},
        "model.head": "rest",
        "head": "full",  # the Wrapper's own head, matched by the glob, has no blocks: compiled whole
    }
    share = share_outside(tiny_gpt, tiny_gpt.blocks)
    assert (
        f"model (GPT): {share:.1%} of its parameters and buffers outside its 3 blocks (>= regional_outer_min_share "
        "10%), and it loops over its blocks in its own forward, so it cannot be compiled around them: its parts with "
        "weights compiled as their own regions (rest: compile)"
    ) in notes(plan)
    assert "(rest: outer)" not in notes(plan), "one note for the one decision: the parts are regions, not an outer one"


@pytest.mark.parametrize("wrap", [Wrapper, SlicingWrapper], ids=["loops_over_its_blocks", "weights_all_in_the_break"])
def test_on_a_gpu_heavy_parts_no_outer_region_can_hold_compile_in_the_background(tiny_gpt, wrap):
    """Where ``auto`` would take ``compile`` (the GPT loops over its own blocks, or all the weights around the blocks
    lie in the module that does), the first step would compile the embeddings and head beside the blocks: on a GPU
    they go to the background thread instead (``background_rest``, as ``apply_policy`` asks there)."""
    root = wrap(tiny_gpt)
    background = resolve_plan(root, to_policy("regional"), background_rest=True)
    rest = {r.name: r.background for r in background.regions if r.role == "rest"}
    assert rest == {"model.embed": True, "model.head": True}
    assert [r.background for r in background.regions if r.role == "block"] == [False] * 3
    assert "on a background thread after the first step, which compiles only the blocks" in notes(background)
    assert "(rest: background)" in notes(background) and "(rest: compile)" not in notes(background)
    foreground = resolve_plan(root, to_policy("regional"))
    assert {r.name: r.background for r in foreground.regions if r.role == "rest"} == dict.fromkeys(rest, False)


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_a_threshold_outside_0_to_1_is_refused(threshold):
    with pytest.raises(PolicyError, match=r"regional_outer_min_share must be in \[0, 1\].*got " + str(threshold)):
        to_policy("regional", regional_outer_min_share=threshold)
