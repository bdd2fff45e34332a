"""Gradients that outlive a CUDA-graph step get their own memory (copy_cuda_graph_gradients).

CUDA graphs do not run on the CPU (Inductor skips them there), so these tests check the mechanism: which
parameters are hooked, that ``.grad`` is no longer the tensor backward produced, when the callback installs
the hooks, and that accumulated training still matches eager. On a GPU, a small GPT under ``regional`` checks
the real thing: CUDA graphs with gradient accumulation against eager.
"""

from dataclasses import asdict
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, apply_policy, to_policy
from compile_trainer.compiling.cuda_graph_grads import copy_cuda_graph_gradients
from compile_trainer_recipes.gpt import GPTConfig, LanguageModel
from tests.conftest import quiet_cpu_trainer

CUDA_GRAPHS = {"triton.cudagraphs": True}


class TwoNets(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.head = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.head(self.net(batch[0])), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def cuda_graph_net_policy(**settings):
    """``net`` compiled with CUDA graphs asked for (eager backend: no compile cost), ``head`` eager."""
    return to_policy({"rules": [{"name": "net", "action": "full", "options": CUDA_GRAPHS}]} | settings)


def incoming_and_installed_grads(module: TwoNets, copies: bool):
    """For ``net.0.weight``: the pointer of the gradient backward hands to autograd, and of ``.grad``."""
    applied = apply_policy(module, cuda_graph_net_policy(backend="inductor"))
    incoming = []
    weight = module.net[0].weight
    weight.register_hook(lambda grad: incoming.append(grad.data_ptr()))  # runs before the copy hook
    hooks = copy_cuda_graph_gradients(applied) if copies else None
    module.training_step((torch.randn(2, 4), torch.randn(2, 1)), 0).backward()
    return hooks, incoming[0], weight.grad.data_ptr()


def test_gradients_of_cuda_graph_regions_are_copied_before_they_accumulate():
    torch.manual_seed(0)
    hooks, incoming, installed = incoming_and_installed_grads(TwoNets(), copies=False)
    assert installed == incoming, "without the hook, autograd installs backward's own output as .grad"
    torch._dynamo.reset()
    module = TwoNets()
    hooks, incoming, installed = incoming_and_installed_grads(module, copies=True)
    assert installed != incoming, ".grad is a copy"
    assert hooks.parameters == 4, "net's two weights and biases; the eager head is not hooked"
    assert not module.head.weight._backward_hooks
    hooks.remove()
    assert len(module.net[0].weight._backward_hooks) == 1, "only the test's own hook is left"


def test_no_gradient_copies_without_cuda_graphs():
    applied = apply_policy(TwoNets(), to_policy({"rules": [{"name": "net", "action": "full"}]}))
    assert copy_cuda_graph_gradients(applied).parameters == 0


class CopiesDuringFit(pl.Callback):
    def __init__(self, compile_callback):
        self.compile_callback, self.seen = compile_callback, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(self.compile_callback.gradient_copies is not None)


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(policy, accumulate):
    pl.seed_everything(0)
    module = TwoNets()
    data = DataLoader([(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(8)], batch_size=None)
    callbacks = [LossRecorder()]
    if policy is not None:
        compile_callback = CompileCallback(policy, print_plan=False, telemetry=False)
        callbacks += [compile_callback, CopiesDuringFit(compile_callback)]
    trainer = quiet_cpu_trainer(max_steps=8 // accumulate, accumulate_grad_batches=accumulate, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=data)
    return module, callbacks


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_callback_copies_gradients_only_when_they_outlive_a_step(accumulate):
    eager, (eager_losses, *_) = fit(None, accumulate)
    module, (losses, compile_callback, during_fit) = fit(cuda_graph_net_policy(backend="inductor"), accumulate)
    assert during_fit.seen == [accumulate > 1] * 8
    assert compile_callback.gradient_copies is None, "removed at teardown"
    assert not module.net[0].weight._backward_hooks
    assert losses.losses == pytest.approx(eager_losses.losses, rel=1e-5)
    for compiled, reference in zip(module.parameters(), eager.parameters()):
        torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-6)


# The check benchmarks/cuda_graph_checks.py ran (its GPU result: docs/BENCHMARKS.md, "CUDA graphs with gradient
# accumulation vs eager"): a small GPT under ``regional`` with 1 and 2 micro-batches per optimizer step, its losses
# and weights against the same loop run eagerly. On a GPU the real thing (Inductor, CUDA graphs); on the CPU, where
# Inductor records no CUDA graphs, the plumbing (aot_eager).
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
CHECKED_GPT = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)
if not ON_GPU:
    CHECKED_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
OPTIMIZER_STEPS = 4 if ON_GPU else 2
EAGER_RUNS = {}  # (loop, accumulate): eager training's losses and weights, trained once a session


def seeded_gpt_and_batches(count):
    """The recipe's module (seeded) and ``count`` batches of 4 random token rows, on ``DEVICE``."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CHECKED_GPT.vocab_size, (count, 4, CHECKED_GPT.block_size + 1), generator=generator)
    torch.manual_seed(0)
    module = LanguageModel(model=asdict(CHECKED_GPT), lr=1e-3, warmup_steps=1).to(DEVICE)
    return module, list(tokens.to(DEVICE))


def train_raw(policy, accumulate, copies=False):
    """A hand-written loop, ``accumulate`` micro-batches an AdamW step: the losses and the trained weights."""
    module, batches = seeded_gpt_and_batches(OPTIMIZER_STEPS * accumulate)
    applied = apply_policy(module, policy) if policy is not None else None
    if copies:
        copy_cuda_graph_gradients(applied)
    optimizer, losses = torch.optim.AdamW(module.parameters(), lr=1e-3), []
    for index, batch in enumerate(batches):
        if applied is not None:
            applied.begin_step()
        loss = module.model(batch[:, :-1], batch[:, 1:])[1]
        (loss / accumulate).backward()
        losses.append(float(loss))
        if (index + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, [p.detach().float().cpu() for p in module.parameters()]


def train_lightning(policy, accumulate):
    """A Trainer accumulating ``accumulate`` micro-batches, with CompileCallback (which installs the copies)."""
    module, batches = seeded_gpt_and_batches(OPTIMIZER_STEPS * accumulate)
    recorder = LossRecorder()
    callbacks = [recorder] + ([CompileCallback(policy, print_plan=False, telemetry=False)] if policy else [])
    trainer = quiet_cpu_trainer(
        accelerator=DEVICE.type, devices=1, max_steps=OPTIMIZER_STEPS, accumulate_grad_batches=accumulate,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader([(b[:, :-1], b[:, 1:]) for b in batches], batch_size=None))
    losses = [loss * accumulate for loss in recorder.losses]  # Lightning divides the loss by the accumulation
    return losses, [p.detach().float().cpu() for p in module.parameters()]


LOOPS = {"raw": train_raw, "raw_with_copies": partial(train_raw, copies=True), "lightning": train_lightning}


def assert_regional_trains_like_eager(loop, accumulate):
    """``loop`` under ``regional``: losses and weights (relative norm) within 1e-3 of the same loop run eagerly."""
    reference = ("lightning" if loop == "lightning" else "raw", accumulate)
    if reference not in EAGER_RUNS:
        EAGER_RUNS[reference] = LOOPS[reference[0]](None, accumulate)
    losses, weights = LOOPS[loop](to_policy("regional", backend="inductor" if ON_GPU else "aot_eager"), accumulate)
    eager_losses, eager_weights = EAGER_RUNS[reference]
    assert losses == pytest.approx(eager_losses, rel=1e-3)
    assert max(float((a - b).norm() / b.norm()) for a, b in zip(weights, eager_weights)) < 1e-3


@pytest.mark.parametrize(
    "loop, accumulate",
    [("raw", 1), ("raw_with_copies", 1), ("lightning", 1), ("raw", 2), ("raw_with_copies", 2), ("lightning", 2)],
)
def test_regional_trains_like_eager_with_and_without_gradient_accumulation(loop, accumulate):
    try:
        assert_regional_trains_like_eager(loop, accumulate)
    except RuntimeError as error:
        # Without the copies, a gradient still held at the next micro-batch's CUDA-graph replay is overwritten and
        # PyTorch refuses it (2026-11-22, H100): refused, never silently different. Anything else fails.
        refused = "overwritten by a subsequent run" in str(error)
        if not (ON_GPU and loop == "raw" and accumulate > 1 and refused):
            raise


@pytest.mark.parametrize(
    "mode, options, expected",
    [
        ("reduce-overhead", None, True),
        ("max-autotune", None, True),  # its mode's options hold triton.cudagraphs too
        ("max-autotune-no-cudagraphs", None, False),
        (None, {"triton.cudagraphs": True}, True),
        (None, None, False),
    ],
)
def test_cuda_graphs_are_read_from_the_mode_and_the_options(mode, options, expected):
    from compile_trainer.compiling.arguments import kwargs_use_cuda_graphs

    assert kwargs_use_cuda_graphs({"backend": "inductor", "mode": mode, "options": options}) is expected
