"""Telemetry in a real Lightning fit: throughput without compile steps, FLOPs and MFU, logged series."""

import csv
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.flop_counter import FlopCounterMode

from compile_trainer import CompileCallback
from compile_trainer.schema import SettingsError, to_telemetry_config
from tests import telemetry_models as models

SLOW_COMPILE_S = 1.5
BATCH = 4


@torch._dynamo.register_backend(name="slow_compile_for_tests")
def slow_compile(graph_module, example_inputs):
    """Makes the first step deliberately slow: its compile takes SLOW_COMPILE_S."""
    time.sleep(SLOW_COMPILE_S)
    return graph_module.forward


def fit(module, callback, steps, tmp_path):
    trainer = pl.Trainer(
        max_steps=steps,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[callback],
    )
    trainer.fit(module)
    return trainer


def step_flops() -> int:
    module = models.TinyRegression(batch_size=BATCH)
    inputs, targets = next(iter(module.train_dataloader()))
    with FlopCounterMode(display=False) as counter:
        module.training_step((inputs, targets), 0).backward()
    return counter.get_total_flops()


def test_throughput_excludes_the_slow_compile_step_and_reports_it_separately(tmp_path):
    telemetry = {"items_fn": "tests.telemetry_models:items_in_batch", "peak_tflops": 1e-6, "log_every_n_steps": 2}
    policy = {"rules": [{"name": "net.blocks", "action": "regional"}], "backend": "slow_compile_for_tests"}
    callback = CompileCallback(policy, telemetry=telemetry)
    fit(models.TinyRegression(batch_size=BATCH), callback, steps=6, tmp_path=tmp_path)
    summary = callback.summary()

    assert (summary["steps"], summary["compile_steps"], summary["steady_steps"]) == (6, 1, 5)
    assert summary["first_step_time_s"] >= SLOW_COMPILE_S
    assert summary["compile_steps_time_s"] == summary["first_step_time_s"]
    assert summary["compile_time_s"] >= SLOW_COMPILE_S
    assert summary["steady_samples_per_s"] == pytest.approx(BATCH / summary["steady_step_time_s"])
    assert summary["steady_items_per_s"] == pytest.approx(BATCH * models.WIDTH / summary["steady_step_time_s"])
    assert summary["flops_per_step"] == step_flops() > 0
    assert summary["steady_tflops"] == pytest.approx(summary["flops_per_step"] / summary["steady_step_time_s"] / 1e12)
    assert summary["mfu"] == pytest.approx(summary["steady_tflops"] / 1e-6)
    assert summary["peak_memory_bytes"] is None, "no device memory on the CPU"
    assert (summary["compiles"], summary["recompiles"], summary["graph_breaks"]) == (1, 0, 0)

    rows = list(csv.DictReader(next(tmp_path.glob("**/metrics.csv")).open()))

    def series(key):
        return [float(row[key]) for row in rows if row.get(key)]

    # logged every 2 steps: the first interval's only steady step is its second (the compile step is logged apart),
    # then two steady steps each; together they are the 5 steady steps of the summary, the compile step in none
    step_times, compile_steps = series("throughput/step_time_s"), series("throughput/compile_step_time_s")
    assert len(step_times) == 3 and compile_steps == [pytest.approx(summary["first_step_time_s"])]
    steady_seconds = step_times[0] + 2 * step_times[1] + 2 * step_times[2]
    assert steady_seconds == pytest.approx(summary["steady_steps"] * summary["steady_step_time_s"])
    columns = {"compile/recompiles", "compile/net.blocks/graphs", "throughput/items_per_s", "throughput/mfu"}
    assert columns <= rows[0].keys()


def test_telemetry_off_registers_nothing(tmp_path):
    handler = torch._dynamo.callback.callback_handler
    before = list(handler.start_callbacks)
    policy = {"rules": [{"name": "net.blocks", "action": "regional"}], "backend": "eager"}
    callback = CompileCallback(policy, telemetry=False)
    fit(models.TinyRegression(batch_size=BATCH), callback, steps=2, tmp_path=tmp_path)
    assert callback.telemetry is None and callback.summary() == {}
    assert handler.start_callbacks == before


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"items_fn": "tests.telemetry_models:no_such_function"}, "cannot be imported"),
        ({"items_fn": "tests.telemetry_models:WIDTH"}, "is a int, not a function"),
        ({"items_per_sample": 0}, "must be positive"),
        ({"items_per_sample": 8, "items_fn": "tests.telemetry_models:items_in_batch"}, "not both"),
        ({"peak_tflop": 900}, r"'telemetry.peak_tflop' \(did you mean 'peak_tflops'\?\); valid keys of telemetry: .*"),
    ],
)
def test_bad_telemetry_settings_fail_when_the_callback_is_made(spec, message):
    with pytest.raises(SettingsError, match=message):
        CompileCallback("none", telemetry=spec)
    assert to_telemetry_config({"items_fn": models.items_in_batch}).items_fn is models.items_in_batch


def test_wandb_offline_run_holds_series_event_table_and_summary(tmp_path):
    """``train.py`` as a user runs it: the recipe's tokens are the items, W&B gets tables and a summary."""
    from compile_trainer.runs.wandb_offline import read_offline_run
    from compile_trainer.telemetry.compile_events import EVENT_COLUMNS
    from tests.test_train_script import run_train

    result = run_train(tmp_path, "compile=regional", "compile.backend=eager", "trainer.max_steps=4",
                       "trainer.log_every_n_steps=2", "trainer.val_check_interval=4")  # fmt: skip
    output = result.stdout + result.stderr
    assert "compile telemetry" in output and "steady step" in output, "the summary table is printed"
    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))

    for key in ("compile/compiles", "compile/recompiles", "compile/graph_breaks", "compile/compile_time_s",
                "compile/model.blocks/graphs", "throughput/step_time_s", "throughput/items_per_s"):  # fmt: skip
        assert len(run.series(key)) == 2, key
    assert run.series("throughput/compile_step_time_s"), "the compile step is reported on its own"

    summary = {key[len("summary/") :]: value for key, value in run.summary.items() if key.startswith("summary/")}
    headline = {"compile_time_s", "compiles", "recompiles", "graph_breaks", "unique_graphs", "steady_step_time_s",
                "steady_items_per_s", "steady_samples_per_s", "flops_per_step", "steady_tflops"}  # fmt: skip
    assert headline <= set(summary), headline - set(summary)
    assert summary["steady_items_per_s"] == pytest.approx(16 * 32 / summary["steady_step_time_s"]), "tokens/s"
    assert summary["graph_breaks"] == 0 and summary["compile_time_s"] > 0

    events = run.table("compile/events")
    assert events["columns"] == list(EVENT_COLUMNS)
    recompiles = [row for row in events["data"] if row[0] == "recompile"]
    assert recompiles == [] and summary["recompiles"] == 0, "a fixed-shape fit with validation does not recompile"
    # Validation ran first (the sanity check), under no_grad: each region's training graph is its grad-mode variant.
    assert summary["grad_mode_variants"] == 3
    regions = run.table("compile/regions")
    labels = ["model.embed", "model.blocks", "model.head"]
    assert [row[0] for row in regions["data"]] == labels
