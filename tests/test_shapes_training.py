"""The ``shapes`` section in real Lightning training: compile counts, equal losses, warm-up, strict recompiles."""

import collections
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics
from torch.utils.data import DataLoader

from compile_trainer import CompileCallback, to_policy
from compile_trainer.runs.wandb_offline import read_offline_run
from compile_trainer.shapes.region_inputs import RecompileError
from compile_trainer_recipes.data import TokenBatch
from compile_trainer_recipes.gpt import LanguageModel
from tests.conftest import quiet_cpu_trainer

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16}
BUCKETS = {"pad": {"buckets": [8, 16, 24, 32]}}
TWO_BUCKETS = {"pad": {"buckets": [16, 32]}}


def token_batch(size: int, length: int, seed: int) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(1, 256, (size, length), generator=generator)
    targets = torch.randint(0, 256, (size, length), generator=generator)
    targets[size // 2, length // 2 :] = -100  # one row is shorter, as a collate that pads to the longest makes it
    return TokenBatch(inputs, targets)


class Stream(pl.LightningDataModule):
    """Fixed lists of ready-made batches: the test decides every shape."""

    def __init__(self, train, val=()):
        super().__init__()
        self.train, self.val = list(train), list(val)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=None)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=None)


def varying_stream(batch_size=4, repeats=2, seed=0):
    """``repeats`` x 12 batches of 12 distinct lengths in 5..32, shuffled."""
    lengths = [5, 7, 9, 11, 13, 15, 17, 19, 22, 25, 28, 31] * repeats
    random.Random(seed).shuffle(lengths)
    return [token_batch(batch_size, length, seed=i) for i, length in enumerate(lengths)]


class Recorder(pl.Callback):
    def __init__(self):
        self.losses, self.graphs_at_step_start = [], []  # Dynamo's graphs so far, at each training step's start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.graphs_at_step_start.append(counters["stats"]["unique_graphs"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def tiny_module(dropout=0.0):
    pl.seed_everything(0)
    return LanguageModel(model=MODEL | {"dropout": dropout}, warmup_steps=2, decay_steps=50)


def fit(policy, data, steps=None, dropout=0.0, recorder=None, module=None):
    module = module or tiny_module(dropout)
    recorder = recorder or Recorder()
    compile_callback = CompileCallback(policy, print_plan=False, telemetry=False) if policy else None
    callbacks = [recorder] + ([compile_callback] if policy else [])
    trainer = pl.Trainer(
        max_steps=steps or len(data.train),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=len(data.val),
        num_sanity_val_steps=len(data.val),
        accelerator="cpu",
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    return trainer, recorder, compile_callback


def graphs_per_region(callback: CompileCallback) -> Dict[str, int]:
    """Dynamo's compiled frames by region (the code name of each region's entry function)."""
    frames = collections.Counter(m.co_name for m in get_compilation_metrics())
    return {c.region.name: frames[c.entry_name] for c in callback.applied.compiled}


def test_buckets_and_dynamic_compile_fewer_graphs_than_plain_over_a_varying_stream():
    stream = varying_stream()
    assert len(stream) >= 20 and len({b.inputs.shape[1] for b in stream}) >= 10
    counts = {}
    for name, policy in {
        "plain": to_policy("regional", backend="eager"),
        "plain_static": to_policy("regional", backend="eager", dynamic=False, recompile_limit=5),
        "dynamic": to_policy("dynamic", backend="eager"),
        "buckets": to_policy("buckets", backend="eager", shapes=BUCKETS),
    }.items():
        torch._dynamo.reset()
        clear_compilation_metrics()
        before = counters["stats"]["unique_graphs"]
        _, recorder, callback = fit(policy, Stream(stream))
        counts[name] = graphs_per_region(callback)
        if name == "buckets":
            first, second = recorder.graphs_at_step_start[:2]
            assert first == before, "nothing compiled before the first step: no warm-up step ran user code"
            assert counters["stats"]["unique_graphs"] == second, "every bucket compiled by the step after the first"
            assert second - before == 4 * 3, "4 buckets x 3 entries (the blocks share one)"
    regions = ["model.embed", "model.blocks.0", "model.blocks.1", "model.head"]
    assert list(counts["buckets"]) == regions
    assert all(counts["buckets"][r] == 4 for r in regions), counts["buckets"]
    assert all(counts["dynamic"][r] == 1 for r in regions), "dynamic from the first compile: " + str(counts)
    assert all(counts["plain"][r] == 2 for r in regions), "static first, then automatic dynamic"
    assert sum(counts["plain"].values()) > sum(counts["dynamic"].values())
    assert all(counts["plain_static"][r] == 5 for r in regions), "one per length until the recompile limit"


def test_compiled_shapes_train_like_eager_with_a_smaller_batch_and_another_validation_batch_size():
    train = varying_stream(repeats=1)[:6] + [token_batch(3, 13, seed=99)]  # a smaller last batch
    val = [token_batch(2, length, seed=50 + length) for length in (6, 21, 30)]  # another batch size
    eager_trainer, eager, _ = fit(None, Stream(train, val))
    for policy in (
        to_policy("buckets", backend="aot_eager", shapes=BUCKETS),
        to_policy("dynamic", backend="aot_eager"),
    ):
        torch._dynamo.reset()
        trainer, compiled, _ = fit(policy, Stream(train, val))
        assert len(compiled.losses) == len(train)
        assert compiled.losses == pytest.approx(eager.losses, rel=1e-4), policy.name
        val_loss = float(trainer.callback_metrics["val/loss"])
        assert val_loss == pytest.approx(float(eager_trainer.callback_metrics["val/loss"]), rel=1e-4)


def test_warm_up_leaves_no_trace_in_the_results():
    """Warm-up runs real training steps; with dropout, their RNG draws must not shift the real ones."""
    train = varying_stream(repeats=1)[:5]
    _, warm, _ = fit(to_policy("buckets", backend="eager", shapes=BUCKETS), Stream(train), dropout=0.2)
    torch._dynamo.reset()
    _, cold, _ = fit(
        to_policy("buckets", backend="eager", shapes=BUCKETS | {"warmup": False}), Stream(train), dropout=0.2
    )
    assert warm.losses == cold.losses


def test_strict_recompiles_raises_on_a_new_shape_after_warm_up_and_not_before():
    train = varying_stream(repeats=1)[:6] + [token_batch(3, 13, seed=99)]  # batch size 3: not warmed up
    val = [token_batch(2, length, seed=50 + length) for length in (6, 21, 30)]
    policy = to_policy("buckets", backend="eager", shapes=TWO_BUCKETS | {"strict_recompiles": True})
    before = counters["stats"]["unique_graphs"]
    recorder, module = Recorder(), tiny_module()
    with pytest.raises(RecompileError) as raised:
        fit(policy, Stream(train, val), recorder=recorder, module=module)
    message = str(raised.value)
    assert "compiled region 'model.embed' (Embeddings)" in message and "in training after warm-up" in message
    assert "called with tensors of shape (3, 16)" in message, "the shape that was not warmed up (padded to 16)"
    assert str(raised.value.__cause__) in message, "Dynamo's own words (the failed guard, from torch 2.10 on)"
    # Warm-up compiled 2 buckets for validation (batch 2) and 2 for training (batch 4), for 3 entries,
    # without raising, and the six steps in buckets ran.
    assert counters["stats"]["unique_graphs"] - before == 2 * 2 * 3
    assert len(recorder.losses) == 6
    # The guard lives only inside fit: afterwards the model compiles a new shape as usual.
    module.model(*token_batch(3, 13, seed=1))


def test_train_script_runs_buckets_on_the_variable_length_recipe(tmp_path):
    """``python train.py compile=buckets recipe=gpt_tiny_varlen``: buckets on the variable-length recipe."""
    command = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={tmp_path}",
        "compile=buckets",
        "recipe=gpt_tiny_varlen",
        "compile.backend=aot_eager",
        "compile.shapes.pad.buckets=[16,32]",
        "recipe.module.model.n_layer=2",
        "recipe.module.model.n_embd=32",
        "recipe.module.model.block_size=32",
        "recipe.data.max_bytes=300000",
        "recipe.data.batch_size=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert "@tokens is inputs" in output and "@labels is targets" in output, "the roles resolved at the first batch"
    assert (
        "compile policy 'buckets'" in output
        and "pad @tokens, @attention_mask, @labels, @token_type_ids, @position_ids at dim 1 to buckets [16, 32]"
        in output
    )
    warmed = [int(n) for n in re.findall(r"compile warm-up: (\d+) graphs compiled at other buckets", output)]
    assert sum(warmed) == 2 * 3, "embed, the blocks' entry and head, each at the other bucket, in both modes"
    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    assert run.config["config"]["recipe"]["name"] == "gpt_tiny_varlen"
    assert run.config["compile_policy"]["shapes"]["pad"]["buckets"] == [16, 32]
    losses = run.series("train/loss")
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses) and run.series("val/loss")


def test_telemetry_counts_bucket_warm_up_compiles_as_compiles_not_recompiles():
    callback = CompileCallback(to_policy("buckets", backend="eager", shapes=BUCKETS), print_plan=False)
    trainer = quiet_cpu_trainer(max_steps=6, callbacks=[callback])
    trainer.fit(tiny_module(), datamodule=Stream(varying_stream(repeats=1)[:6]))
    summary = callback.summary()
    assert summary["unique_graphs"] == 4 * 3 and summary["compiles"] == 4 * 3, "4 buckets x 3 entries"
    assert summary["recompiles"] == 0, "every bucket compiled on purpose during warm-up"
    assert not [row for row in callback.telemetry.events() if row[0] == "recompile"]


def test_dynamic_full_background_trains_from_the_first_step_then_one_dynamic_graph_takes_every_length():
    """The bundled no-wait variable-length policy: the first steps run eagerly while the one dynamic graph compiles on
    a thread; from the switch on every length (padded to multiples of 64... here of 8) runs that graph: no
    recompile, losses as eager training's."""
    from tests.test_background import WaitForBackground

    stream = varying_stream(repeats=1)
    _, eager, _ = fit(None, Stream(stream))
    torch._dynamo.reset()
    policy = to_policy("dynamic_full_background", backend="aot_eager", shapes={"pad": {"multiple_of": 8}})
    callback = CompileCallback(policy, print_plan=False)
    recorder = Recorder()
    module = tiny_module()
    trainer = quiet_cpu_trainer(max_steps=len(stream), callbacks=[recorder, callback, WaitForBackground(callback, 2)])
    trainer.fit(module, datamodule=Stream(stream))
    summary = callback.summary()
    assert callback.background.installed and summary["background_eager_steps"] == 2
    assert (summary["compiles"], summary["recompiles"], summary["unique_graphs"]) == (1, 0, 1)
    assert callback.applied.compiled[0].calls == len(stream) - 2  # every step after the switch, whatever its length
    assert recorder.losses == pytest.approx(eager.losses, rel=1e-4)
