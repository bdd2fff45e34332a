"""Under every bundled policy the library runs the user's code exactly as often as Lightning runs it, and FLOPs per
step are still counted.

A LightningModule whose ``training_step`` counts its calls, updates torchmetrics metrics and calls ``self.log``
(the case of issue 30: the FLOPs count used to run ``training_step`` once more on the first batch) is trained with
``CompileCallback(<policy>)`` for each policy in ``conf/compile/``, on three models: a Hugging Face Llama with
grouped-query attention, timm's ViT (rebuilt, ``tests/user_models.TimmViT``) and the recipe's GPT. Backends
``eager``/``aot_eager`` keep it fast; CUDA-graph modes and background compiles fall back as they do on a CPU.
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from compile_trainer import CompileCallback
from compile_trainer.schema import to_policy
from compile_trainer_recipes.data import TokenBatch
from compile_trainer_recipes.gpt import GPT, GPTConfig
from tests.conftest import quiet_cpu_trainer
from tests.user_models import IMAGE, VOCAB, TimmViT, tiny_llama

STEPS, BATCH, LENGTH = 3, 4, 16
POLICIES = sorted(path.stem for path in (Path(__file__).parents[1] / "conf" / "compile").glob("*.yaml"))
# Policies whose shapes section pads or marks token entries (by role: @tokens, @labels, ...).
TOKEN_POLICIES = {name for name in POLICIES if to_policy(name).shapes.active}
# Nested compile regions need an AOT backend; the others trace fastest with eager.
BACKENDS = {"regional_nested": "aot_eager"}


def llama_batches(seed: int, length: int = LENGTH):
    """HF batches (input_ids, attention_mask, labels), the last row padded at its end."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[-1, -5:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def gpt_batches(seed: int, length: int = LENGTH):
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 64, (BATCH, length + 1), generator=generator) for _ in range(STEPS)]
    return [TokenBatch(t[:, :-1], t[:, 1:]) for t in tokens]


def image_batches(seed: int, length: int = LENGTH):
    """(images, classes) tuples, as torchvision-style datasets give them."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        for _ in range(STEPS)
    ]


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama(use_cache=False)  # 4 attention heads, 2 key/value heads

    def forward(self, batch):
        return self.model(**batch).loss


class ViT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = TimmViT()

    def forward(self, batch):
        images, classes = batch
        return torch.nn.functional.cross_entropy(self.model(images), classes)


class RecipeGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=3, n_head=2, n_embd=16))

    def forward(self, batch):
        return self.model(batch.inputs, batch.targets)[1]


MODELS = {"llama_gqa": (Llama, llama_batches), "timm_vit": (ViT, image_batches), "recipe_gpt": (RecipeGPT, gpt_batches)}


def batch_total(batch) -> torch.Tensor:
    """A number exact in any precision that tells batches apart: the sum of the first entry (ids or pixels)."""
    first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
    return first.double().sum()


class CountingModule(pl.LightningModule):
    """User code with effects beyond weights, gradients, buffers and RNG: a counter, metrics and ``self.log``."""

    def __init__(self, name: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = MODELS[name][0]()
        self.calls = 0
        self.batches_seen = torchmetrics.SumMetric()
        self.mean_loss = torchmetrics.MeanMetric()
        self.step_total = torchmetrics.SumMetric()  # called (its forward): the step's value, accumulated too

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = self.net(batch)
        self.batches_seen.update(batch_total(batch))
        self.mean_loss.update(loss.detach())
        self.log("mean_loss", self.mean_loss.compute())  # the mean over every batch seen so far
        self.log("step_total", self.step_total(batch_total(batch)))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class LoggedValues(pl.Callback):
    """What ``self.log`` gave Lightning at each step."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.values.append((float(metrics["mean_loss"]), float(metrics["step_total"])))


def train(name: str, *callbacks):
    """The module after ``STEPS`` steps, and what it logged."""
    module, logged = CountingModule(name), LoggedValues()
    trainer = quiet_cpu_trainer(max_steps=STEPS, callbacks=[*callbacks, logged])
    trainer.fit(module, train_dataloaders=DataLoader(MODELS[name][1](1), batch_size=None))
    assert trainer.global_step == STEPS
    return module, logged.values


@pytest.fixture(scope="module")
def eager():
    """Each model trained without the callback: what user code must see under any policy."""
    results = {}
    for name in MODELS:
        module, logged = train(name)
        results[name] = (module.calls, module.batches_seen.compute(), logged)
    return results


def reference_flops(name: str, length: int = LENGTH) -> int:
    """torch.utils.flop_counter over one eager forward and backward of a first batch of token sequences of
    ``length``, on a model of its own."""
    torch.manual_seed(0)
    net = MODELS[name][0]()
    with FlopCounterMode(display=False) as counter:
        net(MODELS[name][1](1, length)[0]).backward()
    return counter.get_total_flops()


def padded_length(policy: str) -> int:
    """The length the policy pads the batches' sequences to: the step computes on the padding too."""
    pad = to_policy(policy).shapes.pad
    if not pad.enabled or pad.auto is not None:
        return LENGTH  # auto: buckets chosen from the lengths seen, all LENGTH
    if pad.buckets:
        return min(bucket for bucket in pad.buckets if bucket >= LENGTH)
    return -(-LENGTH // pad.multiple_of) * pad.multiple_of


def cases():
    for policy in POLICIES:
        for name in MODELS:
            if policy in TOKEN_POLICIES and name == "timm_vit":
                continue  # their shapes sections name token entries, which an image batch has none of
            yield pytest.param(policy, name, {}, id=f"{policy}-{name}")
            if policy.startswith("buckets"):
                yield pytest.param(policy, name, {"shapes": {"warmup": False}}, id=f"{policy}-no_warmup-{name}")


@pytest.mark.parametrize("policy, name, overrides", list(cases()))
def test_user_code_runs_once_per_step_and_flops_are_counted(policy, name, overrides, eager):
    backend = BACKENDS.get(policy, "eager")
    callback = CompileCallback(
        policy, print_plan=False, telemetry={"print_summary": False}, backend=backend, **overrides
    )
    try:
        module, logged = train(name, callback)
    finally:  # a policy stays applied after fit (a second fit reuses it): undo it, process-wide marks included
        if callback.applied is not None:
            callback.applied.remove()
    calls, seen, eager_logged = eager[name]

    assert module.calls == calls == STEPS, "training_step ran more often than Lightning ran it"
    assert torch.equal(module.batches_seen.compute(), seen), "the metric saw other batches than eager training"
    # one tensor of (steps, 2): pytest.approx takes no nested sequences from pytest 9.2 on
    torch.testing.assert_close(
        torch.tensor(logged), torch.tensor(eager_logged), rtol=1e-4, atol=1e-5, msg="self.log gave other values"
    )
    # a metric is a module without weights: never compiled (its state changes at every call: a recompile each step)
    assert not any(item.region.name.startswith("step_total") for item in callback.applied.compiled)
    summary = callback.summary()
    assert summary["flops_per_step"] == reference_flops(name, padded_length(policy)) > 0
