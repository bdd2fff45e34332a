"""timm's vision families as their recipes train them (tests/vision_models.py: ConvNeXt-T, Swin-T, EfficientNet-B0,
ResNet-50 and ViT shapes at tiny widths, their usual drop path) under the bundled ``regional``, as a GPU plans it:
the blocks no other block shares a structure with, and the parts around the blocks, compiled on a background thread
after the first step (on this CPU through the GPU's gate, as tests/test_rest_background.py does; the compiles, the
thread and the Trainer are real; ``aot_eager``).

Each family: the plan (which blocks compile at the first step, how many graphs, what is compiled whole or in the
background), eager training's losses (drop path in evaluation mode: eager and compiled draw different random
numbers), state_dicts that load both ways, no recompile and no recompile-limit hit, with drop path on as well.

The tier ``vision`` (tests/conftest.py): timm is needed, and without it these tests fail (each builds a model, which
imports timm; not at collection, so that the README's suite, which leaves the tier out, collects this file anywhere).
"""

import lightning.pytorch as pl
import pytest
import torch

from compile_trainer import CompileCallback, format_plan_table, to_policy
from compile_trainer.compiling import regions
from compile_trainer.planning.selection import resolve_plan
from tests.conftest import quiet_cpu_trainer
from tests.test_background import WaitForBackground
from tests.vision_models import BATCHES, Classifier, images

SWIN_STAGE_2 = [f"net.layers.2.blocks.{i}" for i in range(6)]
# family: (blocks, structures, the blocks compiled at the first step, the road of the parts around the blocks)
PLANS = {
    # stage 0's first block has no drop path (the rate starts at 0): a structure of its own; each later stage is
    # one structure (its blocks differ only in their drop-path rate, a graph input)
    "convnext": (
        18,
        5,
        [
            f"net.stages.{s}.blocks.{b}"
            for s, n in ((0, 3), (1, 3), (2, 9), (3, 3))
            for b in range(n)
            if (s, b) != (0, 0)
        ],
        "background",
    ),  # fmt: skip
    # each stage alternates plain and shifted windows: the third stage's 6 blocks are 2 graphs; the two blocks of
    # each other stage (the last's window covers its whole resolution: no shift, but it keeps its target shift) are
    # structures no other block shares
    "swin": (12, 8, SWIN_STAGE_2, "background"),
    # each stage opens with a block of its own (stride, channels); the repeats of stages 3, 4 and 5 are 3 graphs;
    # 10.5% of the weights lie outside the blocks (head convolution, classifier): compiled around them
    "efficientnet": (
        16,
        12,
        [
            "net.blocks.3.1",
            "net.blocks.3.2",
            "net.blocks.4.1",
            "net.blocks.4.2",
            "net.blocks.5.1",
            "net.blocks.5.2",
            "net.blocks.5.3",
        ],
        "outer",
    ),  # fmt: skip
    # each stage opens with a downsampling block; its others are one graph per stage
    "resnet": (
        16,
        8,
        [f"net.layer{s}.{b}" for s, n in ((1, 3), (2, 4), (3, 6), (4, 3)) for b in range(1, n)],
        "background",
    ),  # fmt: skip
    "vit": (6, 2, [f"net.blocks.{b}" for b in range(1, 6)], "background"),  # block 0: no drop path
}
WHOLE_ON_A_CPU = {"swin", "efficientnet", "resnet"}  # every structure at the first step: too few blocks per graph


@pytest.mark.parametrize("family", PLANS)
def test_the_plan_compiles_the_shared_block_structures_at_the_first_step(family):
    blocks, structures, first_step, rest = PLANS[family]
    plan = resolve_plan(Classifier(family), to_policy("regional"), background_rest=True)
    block_regions = [r for r in plan.regions if r.role == "block"]
    assert len(block_regions) == blocks and len({r.structure for r in block_regions}) == structures
    assert [r.name for r in block_regions if not r.background] == first_step
    graphs = len({r.structure for r in block_regions if not r.background})
    shared = [r for r in block_regions if sum(o.structure == r.structure for o in block_regions) > 1]
    assert sorted(r.name for r in shared) == sorted(first_step), "the first step compiles the shared structures"
    notes = "\n".join(plan.notes)
    assert f"{graphs} graph{'s' if graphs > 1 else ''} at the first step" in notes, notes
    others = {r.role for r in plan.regions if r.role != "block"}
    if rest == "outer":
        assert others == {"outer"} and "(rest: outer)" in notes
        assert [r.breaks for r in plan.regions if r.role == "outer"] == [["net.blocks"]], "one break, not per stage"
    else:
        assert others == {"rest"} and all(r.background for r in plan.regions if r.role == "rest")
    on_a_cpu = resolve_plan(Classifier(family), to_policy("regional"))
    whole = [r.role for r in on_a_cpu.regions] == ["full"]
    assert whole == (family in WHOLE_ON_A_CPU), [(r.name, r.role) for r in on_a_cpu.regions]
    if whole:
        assert f"{blocks} blocks in {structures} structures" in "\n".join(on_a_cpu.notes)
        assert "below regional_min_reuse 3: compiled whole" in "\n".join(on_a_cpu.notes)


def fit(family, drop_path, compiled, steps=BATCHES):
    """``steps`` steps of ``family``; ``compiled``: under ``regional`` through the GPU's gate for background compiles,
    the install after step 2. Returns (module, callback or None)."""
    pl.seed_everything(0)
    module = Classifier(family, drop_path=drop_path)
    callbacks = []
    if compiled:
        callback = CompileCallback("regional", backend="aot_eager", telemetry={"measure_flops": False})
        callbacks = [callback, WaitForBackground(callback, 2)]
    quiet_cpu_trainer(max_steps=steps, callbacks=callbacks).fit(module, images(family))
    return module, (callbacks[0] if compiled else None)


def assert_compiled_as_planned(callback, family):
    summary = callback.summary()
    assert callback.background.installed and summary["background_eager_steps"] == 2
    assert (summary["recompiles"], summary["recompile_limit_hits"]) == (0, 0), callback.telemetry.compile.events
    assert summary["graph_breaks"] == 0, "only the breaks the plan declares"
    blocks, structures, first_step, _ = PLANS[family]
    block_items = [item for item in callback.applied.compiled if item.region.role == "block"]
    assert len(block_items) == blocks and len({item.entry_name for item in block_items}) == structures
    assert "regional block (background)" in format_plan_table(callback.applied)


@pytest.mark.parametrize("family", PLANS)
def test_regional_trains_like_eager_and_its_state_dicts_load_both_ways(family, monkeypatch, tmp_path):
    eager, _ = fit(family, drop_path=False, compiled=False)
    monkeypatch.setattr(regions, "_may_compile_rest_in_background", lambda policy, device: True)
    compiled, callback = fit(family, drop_path=False, compiled=True)
    torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-5, atol=1e-6)
    assert_compiled_as_planned(callback, family)

    torch.save(compiled.state_dict(), tmp_path / "compiled.pt")
    loaded = Classifier(family)
    loaded.load_state_dict(torch.load(tmp_path / "compiled.pt"))  # strict: the keys of the eager model
    for (name, got), want in zip(loaded.state_dict().items(), compiled.state_dict().values()):
        assert torch.equal(got, want), name
    torch.save(eager.state_dict(), tmp_path / "eager.pt")
    compiled.load_state_dict(torch.load(tmp_path / "eager.pt"))
    for (name, got), want in zip(compiled.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(got, want), name


# ResNet-50 has no drop path; the ViT's (one structure sharing the rates) trains in tests/test_vision_benchmark.py
@pytest.mark.parametrize("family", ["convnext", "swin", "efficientnet"])
def test_drop_path_trains_compiled_without_recompiles(family, monkeypatch):
    """As the recipes train them: each block's drop path draws, the blocks sharing a graph pass their rates to it."""
    monkeypatch.setattr(regions, "_may_compile_rest_in_background", lambda policy, device: True)
    module, callback = fit(family, drop_path=True, compiled=True)
    assert_compiled_as_planned(callback, family)
    assert all(torch.isfinite(loss) for loss in module.losses) and len(module.losses) == BATCHES
