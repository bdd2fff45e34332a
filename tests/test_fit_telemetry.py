"""Telemetry in a real Lightning fit: throughput without compile steps, FLOPs and MFU, logged series."""

import csv
import inspect
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch._inductor import cudagraph_trees
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from compile_trainer import CompileCallback, compat
from compile_trainer.lightning.fit_telemetry import FitTelemetry
from compile_trainer.lightning.no_telemetry import NoTelemetry
from compile_trainer.schema import SettingsError, to_telemetry_config
from tests import telemetry_models as models
from tests import user_models

SLOW_COMPILE_S = 1.5
BATCH = 4
# torch 2.9.1 counts no FLOPs during a compiled step (its guards see the counting mode: compat.flop_counting_problem)
COUNTS_FLOPS = compat.flop_counting_problem() is None


@torch._dynamo.register_backend(name="slow_compile_for_tests")
def slow_compile(graph_module, example_inputs):
    """Makes the first step deliberately slow: its compile takes SLOW_COMPILE_S."""
    time.sleep(SLOW_COMPILE_S)
    return graph_module.forward


def fit(module, callback, steps, tmp_path, logger=None):
    """A CPU fit of ``steps``, logged by ``logger`` (a CSV log under ``tmp_path`` by default)."""
    trainer = pl.Trainer(
        max_steps=steps,
        logger=logger or CSVLogger(tmp_path),
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
    if COUNTS_FLOPS:
        assert summary["flops_per_step"] == step_flops() > 0
        assert summary["steady_tflops"] == pytest.approx(
            summary["flops_per_step"] / summary["steady_step_time_s"] / 1e12
        )
        assert summary["mfu"] == pytest.approx(summary["steady_tflops"] / 1e-6)
    else:
        assert summary["flops_per_step"] is None and summary["mfu"] is None
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
    columns = {"compile/recompiles", "compile/net.blocks/graphs", "throughput/items_per_s"}
    assert columns | ({"throughput/mfu"} if COUNTS_FLOPS else set()) <= rows[0].keys()


def test_telemetry_off_registers_nothing(tmp_path):
    handler = torch._dynamo.callback.callback_handler
    before = list(handler.start_callbacks)
    policy = {"rules": [{"name": "net.blocks", "action": "regional"}], "backend": "eager"}
    callback = CompileCallback(policy, telemetry=False)
    fit(models.TinyRegression(batch_size=BATCH), callback, steps=2, tmp_path=tmp_path)
    assert isinstance(callback.telemetry, NoTelemetry) and callback.summary() == {}
    assert handler.start_callbacks == before


def test_no_telemetry_has_the_methods_of_fit_telemetry():
    """The callback calls its telemetry without asking whether it is on: the stand-in answers every public method
    of the real one, with the same parameters."""

    def methods(cls):
        found = {name: inspect.signature(f) for name, f in vars(cls).items() if callable(f) and not name[0] == "_"}
        return {name: [(p.name, p.kind, p.default) for p in sig.parameters.values()] for name, sig in found.items()}

    assert methods(NoTelemetry) == methods(FitTelemetry)
    assert (NoTelemetry.enabled, FitTelemetry.enabled) == (False, True)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"items_fn": "tests.telemetry_models:no_such_function"}, "cannot be imported"),
        ({"items_fn": "tests.telemetry_models:WIDTH"}, "is a int, not a function"),
        ({"items_per_sample": 0}, "must be positive"),
        ({"items_per_sample": 8, "items_fn": "tests.telemetry_models:items_in_batch"}, "not both"),
        ({"items_per_sample": 8, "items_unit": "video frames"}, "items_unit must be a word such as tokens or frames"),
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
                "compile/model.blocks/graphs", "throughput/step_time_s", "throughput/items_per_s",
                "throughput/tokens_per_s", "throughput/samples_per_s"):  # fmt: skip
        assert len(run.series(key)) == 2, key
    assert run.series("throughput/compile_step_time_s"), "the compile step is reported on its own"

    summary = {key[len("summary/") :]: value for key, value in run.summary.items() if key.startswith("summary/")}
    headline = {"compile_time_s", "compiles", "recompiles", "graph_breaks", "unique_graphs", "steady_step_time_s",
                "steady_items_per_s", "steady_samples_per_s"}  # fmt: skip
    headline |= {"flops_per_step", "steady_tflops"} if COUNTS_FLOPS else set()
    assert headline <= set(summary), headline - set(summary)
    assert summary["steady_items_per_s"] == pytest.approx(16 * 32 / summary["steady_step_time_s"]), "tokens/s"
    assert summary["steady_tokens_per_s"] == summary["steady_padded_tokens_per_s"] == summary["steady_items_per_s"]
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


class DropInLlama(pl.LightningModule):
    """A Hugging Face model in a plain LightningModule, with HF batches whose last row is padded."""

    def __init__(self, padded: int = 5, **config):
        super().__init__()
        torch.manual_seed(0)
        self.model = user_models.tiny_llama(use_cache=False, **config)
        self.padded = padded

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(8):
            ids = torch.randint(1, user_models.VOCAB, (BATCH, LENGTH), generator=generator)
            mask = torch.ones_like(ids)
            mask[-1, LENGTH - self.padded :] = 0
            batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
        return DataLoader(batches, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


LENGTH = 16


def test_tokens_samples_and_mfu_of_a_drop_in_hf_model_need_no_configuration(tmp_path):
    """Tokens/s (real ones by the attention mask, and with padding), samples/s and MFU of a drop-in LightningModule
    with HF batches: in the summary, the W&B series and the printed table. Only the CPU's peak is given (MFU)."""
    from compile_trainer.runs.wandb_offline import read_offline_run

    callback = CompileCallback("regional", backend="eager", telemetry={"peak_tflops": 1e-3, "log_every_n_steps": 2})
    fit_logged_to_wandb(DropInLlama(), callback, 8, tmp_path)
    summary = callback.summary()

    real, positions = BATCH * LENGTH - 5, BATCH * LENGTH
    time = summary["steady_step_time_s"]
    assert summary["steady_steps"] >= 6
    assert summary["steady_tokens_per_s"] == pytest.approx(real / time)
    assert summary["steady_padded_tokens_per_s"] == pytest.approx(positions / time)
    assert summary["steady_samples_per_s"] == pytest.approx(BATCH / time)
    assert summary["steady_items_per_s"] == summary["steady_tokens_per_s"], "items are tokens unless told otherwise"
    if COUNTS_FLOPS:
        assert summary["flops_per_step"] > 0 and summary["mfu"] == pytest.approx(summary["steady_tflops"] / 1e-3)

    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    tokens, padded, samples = (run.series(f"throughput/{key}") for key in ("tokens_per_s", "padded_tokens_per_s",
                                                                            "samples_per_s"))  # fmt: skip
    assert len(tokens) == len(padded) == len(samples) >= 3
    for real_rate, padded_rate, sample_rate in zip(tokens, padded, samples):
        assert real_rate / sample_rate == pytest.approx(real / BATCH)
        assert padded_rate / sample_rate == pytest.approx(positions / BATCH)
    assert run.summary["summary/steady_tokens_per_s"] == pytest.approx(summary["steady_tokens_per_s"])
    if COUNTS_FLOPS:
        assert run.series("throughput/mfu") and run.series("throughput/tflops")
        assert run.summary["summary/mfu"] == pytest.approx(summary["mfu"])

    table = callback.telemetry.format_summary(summary)  # what the end of fit prints
    tokens_text = (
        f"{summary['steady_tokens_per_s']:,.0f} tokens/s ({summary['steady_padded_tokens_per_s']:,.0f} with padding)"
    )
    assert tokens_text in table and f"{summary['steady_samples_per_s']:,.1f} samples/s" in table
    assert f"MFU {summary['mfu'] * 100:,.1f} %" in table if COUNTS_FLOPS else "MFU" not in table


def test_an_image_batch_reports_images_per_second_and_no_unit_it_does_not_have(tmp_path):
    """An image batch ``(pixels, classes)``: images/s in the summary, the W&B series and the printed table; items are
    the images; no tokens/s, and nothing printed for a unit the batch does not have."""
    from compile_trainer.runs.wandb_offline import read_offline_run

    callback = CompileCallback("regional", backend="eager", telemetry={"print_summary": False, "log_every_n_steps": 2})
    fit_logged_to_wandb(ImageClassifier(), callback, 6, tmp_path)
    summary = callback.summary()
    images_per_s = BATCH / summary["steady_step_time_s"]
    assert summary["steady_images_per_s"] == pytest.approx(images_per_s) == summary["steady_samples_per_s"]
    assert summary["items_unit"] == "images" and summary["steady_items_per_s"] == summary["steady_images_per_s"]
    assert summary["steady_tokens_per_s"] is None and summary["steady_padded_tokens_per_s"] is None
    assert ((summary["flops_per_step"] or 0) > 0) == COUNTS_FLOPS

    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    images, samples = run.series("throughput/images_per_s"), run.series("throughput/samples_per_s")
    assert len(images) >= 2 and images == samples and not run.series("throughput/tokens_per_s")
    assert run.summary["summary/steady_images_per_s"] == pytest.approx(summary["steady_images_per_s"])
    assert run.summary["summary/items_unit"] == "images"

    throughput = callback.telemetry.format_summary(summary).split("\nthroughput\n")[1]
    assert f"{summary['steady_images_per_s']:,.1f} images/s" in throughput
    for absent in ("samples/s", "tokens/s", "items/s", "MFU", "peak memory", " -,", " - "):
        assert absent not in throughput, absent


class ImageClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = user_models.TimmViT()

    def training_step(self, batch, batch_idx):
        images, classes = batch
        return torch.nn.functional.cross_entropy(self.model(images), classes)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(8 * BATCH, 3, user_models.IMAGE, user_models.IMAGE, generator=generator)
        classes = torch.randint(0, 10, (8 * BATCH,), generator=generator)
        return DataLoader(TensorDataset(images, classes), batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordsCudaGraphs(models.TinyRegression):
    """Steps 3 and 4 fire the compile callbacks as Inductor's CUDA graph trees do when they record a graph (the
    CPU has no CUDA graphs to record)."""

    def training_step(self, batch, batch_idx):
        if batch_idx in (3, 4):
            with torch._dynamo.callback.callback_handler.install_callbacks(
                torch._dynamo.callback.CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"
            ):
                pass
        return super().training_step(batch, batch_idx)


def test_steps_that_record_cuda_graphs_are_not_steady(tmp_path):
    policy = {"rules": [{"name": "net.blocks", "action": "regional"}], "backend": "eager"}
    callback = CompileCallback(policy, telemetry={"print_summary": False})
    fit(RecordsCudaGraphs(batch_size=BATCH), callback, steps=8, tmp_path=tmp_path)
    summary = callback.summary()
    assert (summary["steps"], summary["compile_steps"], summary["cudagraph_recording_steps"]) == (8, 3, 2)
    assert summary["steady_steps"] == 5 and summary["warmup_steps"] == 0, "the FLOPs were counted in the compile step"


class WarmsUpCudaGraphs(models.TinyRegression):
    """Step 5 adds a function to this thread's CUDA-graph trees' warmed-up set, as the trees do when a step runs a
    new compiled function (a region a background compile just installed) unrecorded; nothing compiles in it. (The
    CPU has no CUDA graphs: the container stands in for the one a GPU run creates per device.)"""

    def training_step(self, batch, batch_idx):
        if batch_idx == 5:
            containers = cudagraph_trees.get_obj(cudagraph_trees.local, compat.TREE_CONTAINERS)
            containers[WARMED_DEVICE].tree_manager.warmed_up_functions.add("installed region")
        return super().training_step(batch, batch_idx)


WARMED_DEVICE = 99  # no real device's index


@pytest.fixture
def cudagraph_tree_container():
    containers = cudagraph_trees.get_obj(cudagraph_trees.local, compat.TREE_CONTAINERS)
    containers[WARMED_DEVICE] = SimpleNamespace(tree_manager=SimpleNamespace(warmed_up_functions={"block"}))
    yield
    del containers[WARMED_DEVICE]


def test_a_step_that_warms_up_cuda_graphs_is_not_steady(tmp_path, cudagraph_tree_container):
    """The step after a background install ran 477 ms against 22 ms on the GPU (its graphs warming up): it compiled
    nothing, and counting it steady put the drop-in ViT's summary 14% under the benchmark's own clock."""
    policy = {"rules": [{"name": "net.blocks", "action": "regional"}], "backend": "eager"}
    callback = CompileCallback(policy, telemetry={"print_summary": False})
    fit(WarmsUpCudaGraphs(batch_size=BATCH), callback, steps=8, tmp_path=tmp_path)
    summary = callback.summary()
    assert (summary["compile_steps"], summary["warmup_steps"], summary["cudagraph_warmup_steps"]) == (1, 1, 1)
    assert summary["steady_steps"] == 6 and summary["cudagraph_recording_steps"] == 0
    assert "1 warm-up (FLOPs counted, cache loaded or CUDA graphs warmed up)" in callback.telemetry.format_summary(
        summary
    )


def test_without_compiles_the_counted_step_is_a_warm_up_step(tmp_path):
    """Under ``none`` nothing compiles: the step whose FLOPs were counted (every op through a dispatch mode) is
    still kept out of steady state, as a warm-up step."""
    callback = CompileCallback("none", telemetry={"print_summary": False})
    fit(models.TinyRegression(batch_size=BATCH), callback, steps=6, tmp_path=tmp_path)
    summary = callback.summary()
    counted = int(COUNTS_FLOPS)  # no count (torch 2.9.1): no warm-up step either
    steps = (summary["steps"], summary["compile_steps"], summary["warmup_steps"], summary["steady_steps"])
    assert steps == (6, 0, counted, 6 - counted) and summary["compiles"] == 0
    assert (summary["warmup_steps_time_s"] > 0) == COUNTS_FLOPS
    assert summary["flops_per_step"] == (step_flops() if COUNTS_FLOPS else None)


def test_items_fn_on_the_command_line_beside_a_recipes_tokens_per_sample_says_how_to_clear_it():
    """The recipe sets telemetry.items_per_sample from its tokens_per_sample: the composed config names both values
    and the override that clears one; with it, the config is valid."""
    from hydra import compose, initialize_config_dir

    from compile_trainer.runs.hydra_configs import register_configs

    register_configs()  # the structured schemas train.py registers
    conf = Path(__file__).resolve().parents[1] / "conf"
    items_fn = "telemetry.items_fn=tests.telemetry_models:items_in_batch"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        both = compose("config", overrides=["recipe=gpt_tiny", items_fn])
        cleared = compose("config", overrides=["recipe=gpt_tiny", items_fn, "telemetry.items_per_sample=null"])
    with pytest.raises(SettingsError, match=r"not both .*items_per_sample 128.*add telemetry.items_per_sample=null"):
        to_telemetry_config(OmegaConf.to_container(both.telemetry, resolve=True))
    valid = to_telemetry_config(OmegaConf.to_container(cleared.telemetry, resolve=True))
    assert valid.items_fn == "tests.telemetry_models:items_in_batch" and valid.items_per_sample is None


def test_the_median_steady_step_is_the_middle_steady_step_and_leaves_the_outlier_to_the_mean():
    from compile_trainer.telemetry import throughput

    class GivenTimes:
        """The meter's clock, reporting the step times given (this checks the arithmetic, not a clock)."""

        def __init__(self, seconds):
            self.seconds, self.done = list(seconds), []

        def start(self):
            pass

        def stop(self, tag):
            self.done.append((self.seconds.pop(0), tag))

        def completed(self, wait):
            done, self.done = self.done, []
            return done

    meter = throughput.ThroughputMeter(torch.device("cpu"))
    meter._clock = GivenTimes([9.0, 0.010, 0.030, 0.5, 0.020, 0.012])
    kinds = [throughput.COMPILE] + [throughput.STEADY] * 5
    for kind in kinds:
        meter.step_start(torch.zeros(BATCH, 3))
        meter.step_end(kind)
    summary = meter.summary()
    assert summary["steady_step_time_median_s"] == pytest.approx(0.020), "the compile step is not a steady step"
    assert summary["steady_step_time_s"] == pytest.approx((0.010 + 0.030 + 0.5 + 0.020 + 0.012) / 5)


def fit_logged_to_wandb(module: pl.LightningModule, callback, steps: int, tmp_path) -> None:
    """A CPU fit of ``steps`` logged to an offline W&B run under ``tmp_path``, the run finished."""
    from lightning.pytorch.loggers import WandbLogger

    trainer = fit(module, callback, steps, tmp_path, logger=WandbLogger(save_dir=tmp_path, offline=True))
    trainer.logger.experiment.finish()
