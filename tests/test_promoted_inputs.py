"""Blocks that get a bfloat16 input where their siblings get float32 (a stage's first block under autocast): one
graph for the shared entry where the block promotes that input anyway, and only there."""

import copy
import json
import socket

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compile_trainer import apply_policy, to_policy
from tests.test_real_models import CLASSIFIER, fit, regional

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)
BLOCKS_ONLY = {
    "backend": "aot_eager",
    "rules": [{"name": "*", "action": "regional", "rest": "eager"}],
}  # the code around the blocks eager


class Block(nn.Module):
    """``x + scale * f(x)``: the sum promotes a bfloat16 ``x`` to float32, as a ConvNeXt block's residual does.
    ``inexact``: ``x * 0.3`` first, which bfloat16 rounds where float32 does not."""

    def __init__(self, inexact=False):
        super().__init__()
        self.proj, self.drop, self.inexact = nn.Linear(16, 16), nn.Dropout(0.25), inexact
        self.scale = nn.Parameter(torch.full((16,), 0.5))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        shortcut = x * 0.3 if self.inexact else x
        return shortcut + self.scale * self.drop(self.proj(x))


class Stage(nn.Module):
    """A downsampling linear (bfloat16 out under autocast), then three blocks of one structure."""

    def __init__(self, inexact=False):
        super().__init__()
        self.down = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block(inexact) for _ in range(3))

    def forward(self, x):
        x = self.down(x)
        for block in self.blocks:
            x = block(x)
        return x.float().square().mean()


def train(model, steps=3):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        with torch.autocast(**AUTOCAST):
            loss = model(torch.randn(4, 16))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, torch.get_rng_state()


@pytest.mark.parametrize("inexact", [False, True], ids=["promoted", "rounded_in_bfloat16"])
def test_a_promoted_input_is_upcast_only_where_the_outputs_stay_equal(inexact):
    torch.manual_seed(1)
    model = Stage(inexact)
    reference = copy.deepcopy(model)
    expected, expected_rng = train(reference)
    applied = apply_policy(model, to_policy(BLOCKS_ONLY))
    before = counters["stats"]["unique_graphs"]
    losses, rng = train(model)
    graphs = counters["stats"]["unique_graphs"] - before
    assert losses == pytest.approx(expected, rel=1e-2)
    assert torch.equal(rng, expected_rng), "the check ran on the same random numbers and drew none of its own"
    assert [int(b.calls) for b in model.blocks] == [3, 3, 3], "the check's call left the block's buffers as they were"
    (item, *others) = [item for item in applied.compiled if item.region.role == "block"]
    assert {other.entry_key for other in others} == {item.entry_key}
    upcast = [note for note in applied.notes if "upcast to float32" in note]
    # the downsampling's graph, and the blocks': their first call ran eagerly, then one float32 graph, or a graph per
    # input dtype where upcasting would round
    if inexact:
        assert not upcast and graphs == 1 + 2
    else:
        assert graphs == 1 + 1
        assert upcast == [
            "blocks.0 and the blocks sharing its graph: bfloat16/float16 inputs upcast to float32, which the block "
            "promotes them to anyway (its outputs checked equal): one graph instead of one per input dtype"
        ]


def test_convnext_stages_compile_one_graph_each_under_bf16_mixed_like_eager():
    """transformers' ConvNeXt under Lightning's bf16-mixed: each stage's first block gets the downsampling's bfloat16
    output, the others float32. 4 stages, a graph each for validation and training, no recompile."""
    _, eager = fit("convnext", CLASSIFIER, precision="bf16-mixed")
    callback = regional()
    _, compiled = fit("convnext", CLASSIFIER, callback, precision="bf16-mixed")
    torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-3, atol=1e-3)
    assert callback.summary()["recompiles"] == 0, callback.telemetry.compile.events
    stages = callback.telemetry.compile.regions
    assert len(stages) == 4 and all((s.compiles, s.graphs) == (2, 2) for s in stages.values()), stages
    assert sum("upcast to float32" in note for note in callback.applied.notes) == 4


def test_a_block_with_forward_hooks_is_not_checked_so_its_inputs_stay_as_they_come():
    """The check calls the block's forward without its hooks (FSDP's all-gather is one): not the same call."""
    torch.manual_seed(1)
    model = Stage()
    reference = copy.deepcopy(model)
    calls = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, output: calls.append(1))
    expected, _ = train(reference)
    applied = apply_policy(model, to_policy(BLOCKS_ONLY))
    losses, _ = train(model)
    assert losses == pytest.approx(expected, rel=1e-2)
    assert len(calls) == 9, "each hook ran once a call, as in eager training"
    assert not [note for note in applied.notes if "upcast to float32" in note]


def test_outside_autocast_inputs_are_never_upcast():
    """A model cast to bfloat16 whole after its blocks' inputs were upcast under autocast keeps its inputs' dtype."""
    torch.manual_seed(1)
    model = Stage().eval()
    reference = copy.deepcopy(model).bfloat16()
    applied = apply_policy(model, to_policy(BLOCKS_ONLY))
    with torch.no_grad(), torch.autocast(**AUTOCAST):
        model(torch.randn(4, 16))
    assert [note for note in applied.notes if "upcast to float32" in note], "decided under autocast"
    model.bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))  # bfloat16 in, as eager (upcast, it would raise)


def _decide_on_rank(rank, world_size, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(1)
        model = Stage(inexact=rank == 1).eval()  # rank 1's blocks round in bfloat16: its check says no
        applied = apply_policy(model, to_policy(BLOCKS_ONLY))
        with torch.no_grad(), torch.autocast(**AUTOCAST):
            model(torch.randn(4, 16))
        (out / f"{rank}.json").write_text(json.dumps([n for n in applied.notes if "upcast to float32" in n]))
    finally:
        dist.destroy_process_group()


def test_under_torch_distributed_the_ranks_decide_together(tmp_path):
    """Rank 0 alone would upcast; with rank 1 saying no, neither does (each would compile other graphs, and with
    compiler collectives wait for the other's)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torch.multiprocessing.spawn(_decide_on_rank, args=(2, port, tmp_path), nprocs=2)
    assert [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)] == [[], []]
