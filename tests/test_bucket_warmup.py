"""Bucket warm-up from recorded region calls (``compile_trainer.shapes.bucket_warmup``): which dims carry the
length, and warm-up under manual optimization (it runs no step, so nothing refuses it)."""

import torch
from torch._dynamo.utils import counters

from compile_trainer import CompileCallback, to_policy
from compile_trainer.shapes.bucket_warmup import length_dims
from recipes.gpt import LanguageModel
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
