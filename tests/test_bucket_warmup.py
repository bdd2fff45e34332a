"""Bucket warm-up from recorded region calls (``compile_trainer.shapes.bucket_warmup``): which dims carry the
length, and warm-up under manual optimization (it runs no step, so nothing refuses it)."""

import lightning.pytorch as pl
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, to_policy
from compile_trainer.shapes.bucket_warmup import length_dims
from compile_trainer_recipes.gpt import LanguageModel
from tests.conftest import quiet_cpu_trainer
from tests.test_shapes_training import MODEL, TWO_BUCKETS, Recorder, Stream, token_batch


def test_the_length_dims_of_region_inputs_where_the_length_equals_other_sizes():
    length, batch = 32, 4
    hidden = torch.randn(batch, length, 32, requires_grad=True)  # hidden size == length
    additive = torch.zeros(batch, 1, length, length)
    additive[..., 5:] = torch.finfo(torch.float32).min
    assert length_dims(hidden, length, batch) == [1], "the last dim of hidden states is its features"
    assert length_dims(additive, length, batch) == [2, 3], "a mask holds the length twice"
    assert length_dims(torch.ones(batch, 1, length, length, dtype=torch.bool), length, batch) == [2, 3]
    assert length_dims(torch.randn(1, length, 32), length, batch) == [1], "a rotary table: (1, T, head dim)"
    assert length_dims(torch.arange(length)[None], length, batch) == [1]
    assert length_dims(torch.randn(length, length, 8), length, length) == [1], "dim 0 is the batch of 32 rows"
    channels_first = torch.randn(batch, 32, length)  # (B, C, T) with C == T, padded at dim 2
    assert length_dims(channels_first, length, batch, batch_dim=2) == [2]
    assert length_dims(torch.randn(batch, 16, 8), length, batch) == [], "nothing of the length"


class ManualLanguageModel(LanguageModel):
    """The recipe's model, optimized by hand."""

    def __init__(self):
        super().__init__(model=MODEL, warmup_steps=2, decay_steps=50)
        self.automatic_optimization = False
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        optimizer = self.optimizers()
        optimizer.zero_grad()
        _, loss = self.model(batch.inputs, batch.targets)
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()


def test_warm_up_compiles_every_bucket_under_manual_optimization_without_running_a_step():
    stream = [token_batch(4, length, seed=i) for i, length in enumerate([9, 20, 11, 30])]  # buckets 16, 32
    torch.manual_seed(0)
    module, recorder = ManualLanguageModel(), Recorder()
    callback = CompileCallback(
        to_policy("buckets", backend="eager", shapes=TWO_BUCKETS), print_plan=False, telemetry={"measure_flops": False}
    )
    before = counters["stats"]["unique_graphs"]
    trainer = quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0, callbacks=[callback, recorder])
    trainer.fit(module, datamodule=Stream(stream))
    assert module.steps == len(stream), "training_step ran once per batch"
    second = recorder.graphs_at_step_start[1]
    assert second - before == 2 * 3 and counters["stats"]["unique_graphs"] == second, (
        "both buckets x 3 entries compiled before the second step, nothing after"
    )
    assert callback.summary()["recompiles"] == 0


class ChannelsFirst(pl.LightningModule):
    """Batches ``{"x": (B, C, T)}`` padded at dim 2; the regions see ``(B, T, C)``: with ``C == T`` at the first
    bucket, warm-up resizes the channels (the batch's padded dim) and its traces fail."""

    def __init__(self):
        super().__init__()
        self.project = nn.Linear(16, 16)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)])

    def training_step(self, batch, batch_idx):
        return self.blocks(self.project(batch["x"].transpose(1, 2))).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_failed_warm_up_trace_is_neither_a_compile_nor_an_eager_fallback_and_its_bucket_compiles_later():
    generator = torch.Generator().manual_seed(0)
    stream = [{"x": torch.randn(4, 16, length, generator=generator)} for length in (10, 20, 12)]  # buckets 16, 32
    shapes = {"pad": {"dim": 2, "buckets": [16, 32], "values": {"x": 0}}}
    callback = CompileCallback(
        to_policy("buckets", backend="eager", shapes=shapes), print_plan=False, telemetry={"measure_flops": False}
    )
    trainer = quiet_cpu_trainer(max_steps=len(stream), limit_val_batches=0, callbacks=[callback])
    trainer.fit(ChannelsFirst(), train_dataloaders=DataLoader(stream, batch_size=None))
    kinds = [e.kind for e in callback.telemetry.compile.events]
    assert "eager_fallback" not in kinds, "a failed warm-up trace ran nothing eagerly"
    summary = callback.summary()
    assert summary["eager_fallbacks"] == 0
    assert summary["compiles"] == summary["unique_graphs"] == 2 * 2, (
        "project and the blocks' entry, each at 16 (step 1) and at 32 (step 2, its batch); the failed traces at 32 "
        "are not counted"
    )
    assert kinds.count("recompile") == 2, "the bucket of 32 compiled at its batch, as without warm-up"
