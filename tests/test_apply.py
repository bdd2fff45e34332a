import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters, get_compilation_metrics
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, PolicyError, apply_policy, compat, format_plan_table, to_policy
from compile_trainer.compiling.plan_table import plan_rows
from compile_trainer_recipes.data import StdlibTextDataModule
from compile_trainer_recipes.gpt import LanguageModel
from tests.conftest import TINY_GPT, Wrapper, quiet_cpu_trainer


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_identical_blocks_compile_one_graph_not_n(tiny_gpt):
    root = Wrapper(tiny_gpt)
    applied = apply_policy(
        root, to_policy({"rules": [{"name": "model", "action": "regional"}], "backend": "aot_eager"})
    )
    before = graphs_compiled()
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8))
    _, loss = root.model(tokens, tokens)
    loss.backward()
    assert graphs_compiled() - before == 1, "three identical blocks share one compiled graph"
    assert [c.calls for c in applied.compiled] == [1, 1, 1]
    assert applied.shared_counts() == {applied.compiled[0].entry_name: 3}


def test_torch_nn_classes_really_capture_graphs():
    """Classes defined in torch.nn are silently skipped by ``module.compile()`` on torch < 2.14."""
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3, enable_nested_tensor=False
    )
    before = graphs_compiled()
    apply_policy(
        nn.Sequential(encoder), to_policy({"rules": [{"name": "0", "action": "regional"}], "backend": "eager"})
    )
    encoder(torch.randn(2, 5, 16, requires_grad=True))  # as from an embedding: no requires_grad recompile
    assert graphs_compiled() - before == 1
    linear = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    before = graphs_compiled()
    apply_policy(linear, to_policy({"rules": [{"name": "*"}], "backend": "eager"}))
    linear(torch.randn(2, 4))
    assert graphs_compiled() - before == 2, "two regions of different classes: one graph each"
    assert not any("0/1" in str(m.compile_id) for m in get_compilation_metrics()), "and no recompile"


def test_policy_applied_twice_is_an_error_and_remove_restores_eager(tiny_gpt):
    root = Wrapper(tiny_gpt)
    applied = apply_policy(root, to_policy("regional", backend="eager"))
    with pytest.raises(PolicyError, match="already applied"):
        apply_policy(root, to_policy("full", backend="eager"))
    assert "model.blocks.0" in format_plan_table(applied)
    applied.remove()
    assert all(compat.compiled_call(m) is None for m in root.modules())
    apply_policy(root, to_policy("full", backend="eager"))


def test_eager_rule_inside_compiled_module_becomes_a_graph_break(tiny_gpt):
    root = Wrapper(tiny_gpt)
    policy = to_policy(
        {"rules": [{"name": "model"}, {"name": "model.blocks.1", "action": "eager"}], "backend": "eager"}
    )
    applied = apply_policy(root, policy)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8))
    with torch.no_grad():
        eager_logits, _ = tiny_gpt.__class__.forward(tiny_gpt, tokens)  # plain call for the reference
    counters["graph_break"].clear()
    logits, _ = root.model(tokens)
    breaks = list(counters["graph_break"])
    assert len(breaks) == 1 and "torch.compiler.disable" in breaks[0], "the graph breaks at the eager block"
    assert torch.allclose(logits, eager_logits, atol=1e-6)
    assert {row["module"]: row["action"] for row in plan_rows(applied)}["model.blocks.1"] == "eager (graph break)"


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit_tiny(policy, steps=4, callbacks=(), ckpt_path=None, module=None):
    pl.seed_everything(0)
    module = module or LanguageModel(
        model=vars(TINY_GPT) | {"block_size": 32, "vocab_size": 256}, warmup_steps=2, decay_steps=steps
    )
    data = StdlibTextDataModule(block_size=32, batch_size=4, max_bytes=200_000)
    recorder = LossRecorder()
    trainer = quiet_cpu_trainer(
        max_steps=steps, callbacks=[recorder, *callbacks] + ([CompileCallback(policy)] if policy else [])
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, recorder.losses


def test_compiled_and_eager_training_give_the_same_losses():
    _, _, eager = fit_tiny(None)
    _, _, regional = fit_tiny(to_policy("regional", backend="aot_eager"))
    _, _, full = fit_tiny(to_policy("full", backend="aot_eager"))
    assert len(eager) == 4 and eager[0] > eager[-1]
    assert regional == pytest.approx(eager, rel=1e-4)
    assert full == pytest.approx(eager, rel=1e-4)


def test_checkpoints_load_both_ways(tmp_path):
    trainer, compiled_module, _ = fit_tiny(to_policy("regional", backend="aot_eager"), steps=3)
    state = compiled_module.state_dict()
    assert not any("_orig_mod" in key for key in state)
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    eager_module = LanguageModel.load_from_checkpoint(tmp_path / "compiled.ckpt")
    assert all(torch.equal(state[k], v) for k, v in eager_module.state_dict().items())

    eager_trainer, eager_trained, _ = fit_tiny(None, steps=3)
    eager_trainer.save_checkpoint(tmp_path / "eager.ckpt")
    # Resume each checkpoint eagerly and under compilation: the same next losses.
    _, _, resumed_compiled = fit_tiny(
        to_policy("regional", backend="aot_eager"), steps=5, ckpt_path=tmp_path / "eager.ckpt"
    )
    _, _, resumed_eager = fit_tiny(None, steps=5, ckpt_path=tmp_path / "eager.ckpt")
    assert len(resumed_compiled) == 2
    assert resumed_compiled == pytest.approx(resumed_eager, rel=1e-4)
    _, _, compiled_then_eager = fit_tiny(None, steps=5, ckpt_path=tmp_path / "compiled.ckpt")
    _, _, compiled_then_compiled = fit_tiny(
        to_policy("regional", backend="aot_eager"), steps=5, ckpt_path=tmp_path / "compiled.ckpt"
    )
    assert compiled_then_eager == pytest.approx(compiled_then_compiled, rel=1e-4)


def test_nested_blocks_are_traced_once_inside_one_graph_and_match_eager(tiny_gpt):
    reference = type(tiny_gpt)(TINY_GPT)
    reference.load_state_dict(tiny_gpt.state_dict())
    root = Wrapper(tiny_gpt)
    policy = to_policy({"rules": [{"name": "model", "action": "regional", "rest": "nested"}], "backend": "aot_eager"})
    applied = apply_policy(root, policy)
    rows = {row["module"]: row for row in plan_rows(applied)}
    assert rows["model"]["action"] == "full, nested blocks" and rows["model.blocks.2"]["shares_graph_with"] == 3
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8))
    before = graphs_compiled()
    _, loss = root.model(tokens, tokens)
    loss.backward()
    _, expected = reference(tokens, tokens)
    expected.backward()
    assert graphs_compiled() - before == 1
    assert torch.allclose(loss, expected, atol=1e-6)
    for got, want in zip(tiny_gpt.parameters(), reference.parameters()):
        assert torch.allclose(got.grad, want.grad, atol=1e-6)
    applied.remove()
    assert not hasattr(type(tiny_gpt.blocks[0]).forward, "__marked_compile_region_fn__")


def test_nested_blocks_refused_where_they_are_not_safe(tiny_gpt):
    with pytest.raises(PolicyError, match="Inductor on the CPU computed wrong gradients"):
        apply_policy(
            Wrapper(tiny_gpt), to_policy({"rules": [{"name": "model", "action": "regional", "rest": "nested"}]})
        )
    assert all(compat.compiled_call(m) is None for m in tiny_gpt.modules()), "nothing compiled before the error"
    with pytest.raises(PolicyError, match="needs an AOT backend"):
        policy = {"rules": [{"name": "model", "action": "regional", "rest": "nested"}], "backend": "eager"}
        apply_policy(Wrapper(tiny_gpt), to_policy(policy))


class NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return x + self.norm(self.fc(x))


def test_nested_blocks_sharing_running_statistics_are_refused_in_training_only():
    """torch's invoke_subgraph refuses blocks sharing a subgraph that update buffers in place in training
    (BatchNorm's running statistics; torch 2.9-2.14): refused before anything compiles, naming the norm; in eval
    mode they run. (From torch 2.13, nested blocks of distinct structures, each its own subgraph called once,
    train: transformers' ResNet in test_real_models.)"""
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(*[NormedBlock() for _ in range(3)]))
    nested = to_policy({"rules": [{"name": "model", "action": "regional", "rest": "nested"}], "backend": "aot_eager"})
    refused = r"block\(s\) 'model.1.0', 'model.1.1', 'model.1.2' hold 'model.1.0.norm' \(BatchNorm1d\).*more than once"
    with pytest.raises(PolicyError, match=refused + r".*rest: compile"):
        apply_policy(Wrapper(model), nested)
    assert all(compat.compiled_call(m) is None for m in model.modules()), "nothing compiled before the error"
    model.eval()
    inputs = torch.randn(5, 4)
    expected = model(inputs)
    applied = apply_policy(Wrapper(model), nested)
    assert [row["action"] for row in plan_rows(applied)][:2] == ["full, nested blocks", "nested block"]
    torch.testing.assert_close(model(inputs), expected)
    applied.remove()


def test_cuda_graph_policies_mark_where_each_step_begins(tiny_gpt):
    """With CUDA graphs, a step that calls several regions must be marked, or the second block's replay
    overwrites outputs the first block saved for backward. Compilation is lazy: nothing runs on a GPU here."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    on_gpu = apply_policy(Wrapper(tiny_gpt), to_policy("regional"), device=torch.device("cuda"))
    on_cpu = apply_policy(Wrapper(copy.deepcopy(tiny_gpt)), to_policy("regional"))
    assert on_gpu.uses_cuda_graphs and not on_cpu.uses_cuda_graphs
    assert not any("needs a GPU" in note for note in on_cpu.notes), "the bundled default's mode: dropped silently"
    before = MarkStepBox.mark_step_counter
    on_cpu.begin_step()
    assert MarkStepBox.mark_step_counter == before
    on_gpu.begin_step()
    assert MarkStepBox.mark_step_counter == before - 1


class LinearRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_callback_marks_every_training_and_validation_step_for_cuda_graphs():
    """Inductor with CUDA graphs asked for: on the CPU they are skipped, but the steps are still marked."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    torch.manual_seed(0)
    data = DataLoader([(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)], batch_size=None)
    policy = {"options": {"triton.cudagraphs": True}, "rules": [{"name": "net", "action": "full"}]}
    callback = CompileCallback(policy, print_plan=False, telemetry=False)
    before = MarkStepBox.mark_step_counter
    trainer = quiet_cpu_trainer(max_steps=3, limit_val_batches=2, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(LinearRegression(), train_dataloaders=data, val_dataloaders=data)
    assert callback.applied.uses_cuda_graphs
    assert before - MarkStepBox.mark_step_counter == 3 + 2, "3 training and 2 validation batches"
