"""Gradients that outlive a CUDA-graph step get their own memory (copy_cuda_graph_gradients).

CUDA graphs do not run on the CPU (Inductor skips them there), so these tests check the mechanism: which
parameters are hooked, that ``.grad`` is no longer the tensor backward produced, when the callback installs
the hooks, and that accumulated training still matches eager. benchmarks/cuda_graph_checks.py runs the real
thing on a GPU.
"""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, apply_policy, to_policy
from compile_trainer.compiling.cuda_graph_grads import copy_cuda_graph_gradients
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


def test_cuda_graph_checks_benchmark_smoke(tmp_path):
    """The GPU check's code cannot rot: its CPU mode runs every loop and compares it with eager."""
    import json
    import subprocess
    import sys

    from tests.benchmark_smoke import ROOT

    out = tmp_path / "checks.json"
    command = [sys.executable, "benchmarks/cuda_graph_checks.py", "--smoke", "--steps", "2", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    loops = ("raw loop, no gradient copies", "raw loop, copy_cuda_graph_gradients", "Lightning + CompileCallback")
    assert [(row["how"], row["accumulate"]) for row in rows] == [(how, n) for n in (1, 2) for how in loops]
    assert all(row["ok"] and row["max_weight_rel_diff"] < 1e-3 for row in rows), rows


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
    from compile_trainer.compiling.regions import kwargs_use_cuda_graphs

    assert kwargs_use_cuda_graphs({"backend": "inductor", "mode": mode, "options": options}) is expected
