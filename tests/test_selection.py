import pytest
from torch import nn

from compile_trainer.planning.selection import resolve_plan
from compile_trainer.planning.stacks import find_repeated_blocks
from compile_trainer.schema import PolicyError, to_policy
from tests.conftest import Wrapper


def plan_for(root, rules, **settings):
    return resolve_plan(root, to_policy({"rules": rules, **settings}))


def test_name_globs_and_class_names_select_modules(tiny_gpt):
    root = Wrapper(tiny_gpt)
    plan = plan_for(root, [{"name": "model.blocks.*", "action": "full"}])
    assert plan.region_names() == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    plan = plan_for(root, [{"class_name": "Block"}])
    assert plan.region_names() == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    plan = plan_for(root, [{"name": "model.**.mlp", "action": "full"}])
    assert plan.region_names() == [f"model.blocks.{i}.mlp" for i in range(3)]
    plan = plan_for(root, [{"name": "*"}])
    assert plan.region_names() == ["model", "head"]
    plan = plan_for(root, [{"name": "model.blocks.*.*", "class_name": "LayerNorm"}])
    assert plan.region_names() == [f"model.blocks.{i}.ln_{j}" for i in range(3) for j in (1, 2)]


def test_later_rules_refine_earlier_ones(tiny_gpt):
    root = Wrapper(tiny_gpt)
    plan = plan_for(
        root,
        [
            {"name": "model", "action": "regional"},
            {"name": "model.blocks.1", "action": "eager"},
            {"name": "model.blocks.2", "action": "full", "mode": "max-autotune"},
        ],
    )
    assert plan.region_names() == ["model.blocks.0", "model.blocks.2"]
    assert plan.eager == {"model.blocks.1": 1}
    by_name = {r.name: r for r in plan.regions}
    assert by_name["model.blocks.0"].settings.mode is None and by_name["model.blocks.0"].role == "block"
    assert by_name["model.blocks.2"].settings.mode == "max-autotune" and by_name["model.blocks.2"].rule_index == 2
    # A later whole-module rule replaces the regional decisions under it.
    plan = plan_for(root, [{"name": "model", "action": "regional"}, {"name": "model", "action": "full"}])
    assert plan.region_names() == ["model"] and plan.eager == {}


def test_eager_inside_a_compiled_module_and_nested_compilation(tiny_gpt):
    root = Wrapper(tiny_gpt)
    plan = plan_for(root, [{"name": "model"}, {"name": "model.blocks.0.attn", "action": "eager"}])
    assert plan.region_names() == ["model"]
    assert plan.enclosing_region("model.blocks.0.attn").name == "model"
    with pytest.raises(PolicyError, match="compile 'model.blocks.0' inside 'model'.*at most once"):
        plan_for(root, [{"name": "model"}, {"name": "model.blocks.0"}])


def test_rule_matching_nothing_lists_nearest_names(tiny_gpt):
    root = Wrapper(tiny_gpt)
    with pytest.raises(PolicyError, match=r"matches no module; nearest module names: .*model\.blocks"):
        plan_for(root, [{"name": "model.block.*"}])
    with pytest.raises(PolicyError, match="class names in the model: Block"):
        plan_for(root, [{"class_name": "Blok"}])


def test_regional_detection_on_the_recipe_model(tiny_gpt):
    assert find_repeated_blocks(tiny_gpt) == [("blocks", ["blocks.0", "blocks.1", "blocks.2"])]
    root = Wrapper(tiny_gpt)
    plan = plan_for(root, [{"name": "model", "action": "regional", "rest": "compile"}])
    roles = {r.name: r.role for r in plan.regions}
    assert roles == {
        "model.embed": "rest",
        "model.blocks.0": "block",
        "model.blocks.1": "block",
        "model.blocks.2": "block",
        "model.head": "rest",
    }
    plan = plan_for(root, [{"name": "model", "action": "regional"}])
    assert {r.role for r in plan.regions} == {"block"}


def test_regional_rest_without_parameters_stays_eager():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]))
    plan = plan_for(nn.Sequential(model), [{"name": "0", "action": "regional", "rest": "compile"}])
    assert plan.region_names() == ["0.0", "0.2.0", "0.2.1", "0.2.2"]
    assert plan.notes == [], "a part without weights runs eagerly, as the plan's rows show: nothing to note"


def test_regional_detection_on_transformer_encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    assert find_repeated_blocks(encoder) == [("layers", ["layers.0", "layers.1", "layers.2"])]
    plan = plan_for(nn.Sequential(encoder), [{"class_name": "TransformerEncoder", "action": "regional"}])
    assert plan.region_names() == ["0.layers.0", "0.layers.1", "0.layers.2"]


def test_a_module_without_repeated_blocks_is_compiled_whole_not_refused(tiny_gpt):
    root = Wrapper(tiny_gpt)
    plan = plan_for(root, [{"name": "model.blocks.0", "action": "regional"}])
    assert [(r.name, r.role) for r in plan.regions] == [("model.blocks.0", "full")]
    assert plan.notes == ["model.blocks.0 (Block) has no repeated blocks at any depth: compiled whole (rule 0)"]
    for rest in ("eager", "compile", "outer", "auto", "nested"):  # as blocks that share too little are
        assert plan_for(root, [{"name": "model.blocks.0", "action": "regional", "rest": rest}]).regions == plan.regions
    dropout = "model.blocks.0.attn.resid_dropout"  # no weights
    plan = plan_for(root, [{"name": dropout, "action": "regional"}])
    assert plan.regions == [] and plan.notes == [f"{dropout}: no parameters or buffers, left eager (rule 0)"]
    # A glob that also matches modules without blocks compiles those whole beside the blocks of the others.
    for rest in ("eager", "compile", "outer"):
        plan = plan_for(root, [{"name": "*", "action": "regional", "rest": rest}])
        assert "head" in plan.region_names() and "model.blocks.0" in plan.region_names(), rest


def test_disabled_policy_plans_nothing(tiny_gpt):
    assert resolve_plan(Wrapper(tiny_gpt), to_policy("none")).regions == []


def test_blocks_of_many_structures_are_compiled_whole_unless_asked_otherwise():
    class Stages(nn.Module):  # widths change per block, as a CNN's stages do: every block its own structure
        def __init__(self, widths):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

    root = Wrapper(Stages([4, 8, 16, 32, 64]))
    rule = [{"name": "*", "action": "regional", "rest": "outer"}]
    plan = plan_for(root, rule)
    assert [(r.name, r.role) for r in plan.regions] == [("model", "full"), ("head", "full")]  # Wrapper's head
    whole = "4 blocks in 4 structures (1.0 per graph), below regional_min_reuse 3: compiled whole"
    assert any(whole in note for note in plan.notes)
    plan = plan_for(root, rule, regional_min_reuse=0)
    assert [r.role for r in plan.regions].count("block") == 4
    same = Wrapper(Stages([8, 8, 8]))  # two blocks of one structure: one block graph is never more work
    assert [r.role for r in plan_for(same, rule).regions].count("block") == 2
    with pytest.raises(PolicyError, match="regional_min_reuse must be >= 0"):
        to_policy("regional", regional_min_reuse=-1)


class Stage(nn.Module):
    """A CNN stage: a downsampling projection, then blocks of one width (``blocks`` of them)."""

    def __init__(self, width_in: int, width: int, blocks: int):
        super().__init__()
        self.downsample = nn.Linear(width_in, width)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(blocks)]
        )


class Staged(nn.Module):
    def __init__(self, depths, stem_blocks: bool = True):
        super().__init__()
        widths = [4 * 2**i for i in range(len(depths) + 1)]
        self.stages = nn.Sequential(*[Stage(widths[i], widths[i + 1], depth) for i, depth in enumerate(depths)])
        if not stem_blocks:
            self.stages[0].blocks = nn.Identity()


def test_blocks_inside_stages_that_differ_are_found_at_that_depth():
    plan = plan_for(Wrapper(Staged([3, 3, 6])), [{"name": "model", "action": "regional"}])
    blocks = [r for r in plan.regions if r.role == "block"]
    assert [r.name for r in blocks][:4] == ["model.stages.0.blocks.0", "model.stages.0.blocks.1",
                                            "model.stages.0.blocks.2", "model.stages.1.blocks.0"]  # fmt: skip
    assert len(blocks) == 12 and len({r.structure for r in blocks}) == 3
    assert (
        "model.stages (Sequential): 3 Stage children in 3 distinct structures (1.0 per graph); the stacks inside them "
        "(model.stages.0.blocks, model.stages.1.blocks, model.stages.2.blocks): 12 blocks in 3 structures (4.0 per "
        "graph): compiled at that depth, the children's other parts as the rest"
    ) in plan.notes
    # too little reuse inside (2 blocks per stage): the stages are the blocks, and share too little: compiled whole
    plan = plan_for(Wrapper(Staged([2, 2, 2])), [{"name": "model", "action": "regional"}])
    assert [(r.name, r.role) for r in plan.regions] == [("model", "full")]
    assert any("6 blocks in 3 structures (2.0 per graph): below regional_min_reuse 3" in note for note in plan.notes)
    # a stage without blocks of its own: its compute would be rest, so the stages stay the blocks
    plan = plan_for(Wrapper(Staged([3, 3, 6], stem_blocks=False)), [{"name": "model", "action": "regional"}])
    assert [(r.name, r.role) for r in plan.regions] == [("model", "full")]


class Lin(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x)


class InvertedResidualStages(nn.Module):
    """An EfficientNet's layout: a Sequential of stages, each opening with a block of other widths, the first and the
    last stage a single block; most of the weights in the head (rest: auto takes outer)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        stages = [(4, 4, 1), (4, 8, 4), (8, 16, 4), (16, 16, 1)]
        self.blocks = nn.Sequential(
            *[nn.Sequential(Lin(a, b), *[Lin(b, b) for _ in range(n - 1)]) for a, b, n in stages]
        )
        self.head = nn.Linear(16, 1000)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def test_shared_structures_compile_at_the_first_step_and_the_others_on_the_thread():
    """10 blocks in 5 structures, 2 of them shared (stage 2's repeats; stage 3's with the last stage's block): with the
    blocks no other block shares on the background thread (a GPU's rest: auto, or rest: background), 2 graphs at the
    first step stand for the 10 blocks; without the thread all 5 compile then (2.0 blocks per graph, below
    regional_min_reuse): the stages stay the blocks, and the model is compiled whole. A stage of one block is a stack
    of it; a Sequential whose stages all break is the one break of the outer region."""
    root = nn.ModuleDict({"model": InvertedResidualStages()})
    plan = resolve_plan(root, to_policy("regional"), background_rest=True)
    blocks = [r for r in plan.regions if r.role == "block"]
    assert len(blocks) == 10 and len({r.structure for r in blocks}) == 5
    deferred = ["model.blocks.0.0", "model.blocks.1.0", "model.blocks.2.0"]
    assert [r.name for r in blocks if r.background] == deferred
    assert [r.breaks for r in plan.regions if r.role == "outer"] == [["model.blocks"]]
    notes = "\n".join(plan.notes)
    assert "10 blocks in 5 structures, 2 of them shared: 2 graphs at the first step (5.0 blocks per graph)" in notes
    assert "model.blocks.0.0, model.blocks.1.0, model.blocks.2.0 (Lin): a structure no other block shares" in notes
    rest_background = {"name": "*", "action": "regional", "rest": "background"}
    explicit = resolve_plan(root, to_policy("regional", rules=[rest_background]))
    assert [r.name for r in explicit.regions if r.role == "block" and r.background] == deferred
    assert "eager until then (rest: background; 10 blocks in 5 structures" in "\n".join(explicit.notes)
    on_a_cpu = resolve_plan(root, to_policy("regional"))
    assert [(r.name, r.role) for r in on_a_cpu.regions] == [("model", "full")]
    notes = "\n".join(on_a_cpu.notes)
    assert "10 blocks in 5 structures (2.0 per graph): below regional_min_reuse 3, the children are the blocks" in notes
    assert (
        "model (InvertedResidualStages): 4 blocks in 4 structures (1.0 per graph), below regional_min_reuse 3" in notes
    )
