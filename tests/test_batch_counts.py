"""Samples, images, tokens and items of any batch, counted without configuration, and the units the summary names."""

from collections import namedtuple

import lightning.pytorch as pl
import pytest
import torch

from compile_trainer import CompileCallback
from compile_trainer.telemetry.batch_counts import first_tensor, is_image_batch
from compile_trainer.telemetry.throughput import STEADY, ThroughputMeter
from compile_trainer.telemetry.throughput_report import format_throughput
from tests import telemetry_models as models

PIXELS = torch.zeros(4, 3, 8, 8)
LABELS = torch.zeros(4, dtype=torch.long)
IDS = torch.ones(4, 16, dtype=torch.long)
Pair = namedtuple("Pair", "inputs targets")


@pytest.mark.parametrize(
    "batch, first",
    [
        (PIXELS, PIXELS),
        ((PIXELS, LABELS), PIXELS),
        ([LABELS, PIXELS], LABELS),
        ({"pixel_values": PIXELS, "labels": LABELS}, PIXELS),
        ({"meta": ["a", "b"], "inputs": (IDS, PIXELS)}, IDS),
        (Pair(PIXELS, LABELS), PIXELS),
        (["no", "tensors"], None),
    ],
)
def test_the_first_tensor_of_a_tensor_tuple_list_or_mapping_depth_first(batch, first):
    assert first_tensor(batch) is first


@pytest.mark.parametrize(
    "batch, images",
    [
        ((PIXELS, LABELS), True),
        ({"pixel_values": PIXELS.half(), "labels": LABELS}, True),
        ((PIXELS.to(torch.uint8), LABELS), False),  # raw bytes, not yet pixels the model takes
        ((torch.zeros(4, 3, 8), LABELS), False),  # a sequence of features
        ((LABELS, PIXELS), False),  # the first tensor decides
        ({"input_ids": IDS}, False),
    ],
)
def test_an_image_batch_is_one_whose_first_tensor_is_n_c_h_w_floats(batch, images):
    assert is_image_batch(batch) == images


def measured(batch, steps=3, **counters):
    meter = ThroughputMeter(torch.device("cpu"), **counters)
    for _ in range(steps):
        meter.step_start(batch)
        meter.step_end(STEADY)
    return meter.summary()


@pytest.mark.parametrize(
    "batch, counters, unit, per_step",
    [
        ((PIXELS, LABELS), {}, "images", 4),
        ((torch.zeros(4, 5), LABELS), {}, "samples", 4),
        ([torch.zeros(4, 5), LABELS], {}, "samples", 4),
        ({"input_ids": IDS, "labels": IDS}, {}, "tokens", 64),
        ((PIXELS, LABELS), {"items_per_sample": 10}, "items", 40),
        ((PIXELS, LABELS), {"items_fn": lambda batch: batch[0].numel()}, "items", PIXELS.numel()),
        ((PIXELS, LABELS), {"items_per_sample": 10, "items_name": "frames"}, "frames", 40),
    ],
)
def test_items_per_second_for_any_batch_in_the_unit_it_names(batch, counters, unit, per_step):
    summary = measured(batch, **counters)
    assert summary["items_unit"] == unit
    assert summary["steady_items_per_s"] == pytest.approx(per_step / summary["steady_step_time_s"])
    assert (summary["steady_images_per_s"] is not None) == is_image_batch(batch)
    assert (summary["steady_tokens_per_s"] is not None) == (unit == "tokens")
    rates = format_throughput(summary)[2]
    assert rates.count(f" {unit}/s") == 1, rates  # named once, where another count has not named it already


def test_the_printed_rates_of_an_x_y_batch_name_samples_and_no_unit_it_lacks(tmp_path):
    """The issue's MLP on ``(x, y)`` batches printed "tokens/s -" and "MFU -, peak memory -" on the CPU."""
    callback = CompileCallback("regional", backend="eager", print_plan=False, telemetry={"print_summary": False})
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", callbacks=[callback])  # fmt: skip
    trainer.fit(models.TinyRegression(batch_size=4))
    summary = callback.summary()
    assert summary["items_unit"] == "samples" and summary["steady_items_per_s"] == summary["steady_samples_per_s"]
    lines = format_throughput(summary)
    assert f"{summary['steady_samples_per_s']:,.1f} samples/s" in lines[2]
    text = "\n".join(lines)
    for absent in ("images/s", "tokens/s", "items/s", "MFU", "peak memory", "speedup", " - ", " -,"):
        assert absent not in text, absent
