"""The real-models GPU benchmark's CPU smoke mode: tiny Llama, GPT-2, ViT and ResNet from transformers' configs;
every requested variant a row (a measurement or an explicit error), the same losses as eager, and a second command
that appends to the first's file."""

import importlib.util
import json
import subprocess
import sys

from tests.benchmark_smoke import ROOT

MODELS = ["llama", "gpt2", "vit", "resnet50"]
# The smoke run's default variants; the policies run with backend aot_eager.
VARIANTS = ["eager", "torch_compile", "compile_regions", "policy_regional", "policy_regional_nested"]


def run(args):
    """``python benchmarks/real_models.py args...`` as a user runs it (omegaconf is needed: the policies)."""
    command = [sys.executable, "benchmarks/real_models.py", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_real_models_smoke_compares_variants_side_by_side(tmp_path):
    out = tmp_path / "real_models.json"
    result = run(["--smoke", "--out", str(out)])
    assert "throughput_vs_full" in result.stdout and "estimate" in result.stdout, "the estimate and the table"

    data = json.loads(out.read_text())
    assert data["benchmark"] == "real_models" and data["title"] and data["notes"]
    for field in ("device", "torch", "triton", "transformers", "date", "command", "isolation"):
        assert field in data["meta"], field
    assert "real_models.py --smoke" in data["meta"]["command"]
    rows = {(row["model"], row["variant"]): row for row in data["rows"]}
    assert list(rows) == [(m, v) for m in MODELS for v in VARIANTS], "every requested variant has a row, in order"

    accelerate = importlib.util.find_spec("accelerate") is not None
    for (_, variant), row in rows.items():
        if variant == "compile_regions" and not accelerate:
            assert row["error"] == "accelerate not installed"
            continue
        assert "error" not in row, row
        assert row["first_step_s"] > 0 and row["step_ms"] > 0 and row["items_per_s"] > 0, row
        assert row["flops_per_step"] > 0 and row["recompiles"] == 0, row
        assert len(row["first_losses"]) == 5
        # every variant trains the same model on the same data: fp32 on the CPU, aot_eager, the same losses
        assert row["loss_rel_diff_vs_eager"] < 1e-4, row
        if variant == "eager":
            assert row["graphs"] == 0 and row["speedup_vs_eager"] == 1
        else:
            assert row["graphs"] >= 1
        assert row["full_compile"] == "torch_compile", "the only full compile of the smoke run"
    for model in MODELS:
        assert rows[(model, "torch_compile")]["throughput_vs_full"] == 1.0
        assert rows[(model, "torch_compile")]["first_step_vs_full"] == 1.0
        if model != "resnet50":  # its blocks come in as many structures as stages: compiled whole
            assert rows[(model, "policy_regional")]["graphs"] >= 3, "blocks, and the rest as their own regions"

    # A second command appends to the file: a policy that does not exist is an error row, not a crash, and the
    # first command's rows and ratios stay.
    second = ["--smoke", "--models", "gpt2", "--variants", "--policies", "no_such", "--append", "--out", str(out)]
    assert "policy_no_such" in run(second).stdout
    data = json.loads(out.read_text())
    merged = {(row["model"], row["variant"]): row for row in data["rows"]}
    assert list(merged) == [*rows, ("gpt2", "policy_no_such")]
    assert "unknown compile policy 'no_such'" in merged[("gpt2", "policy_no_such")]["error"]
    for key, row in rows.items():
        assert merged[key].get("throughput_vs_full") == row.get("throughput_vs_full"), key
    assert data["meta"]["command"].count("real_models.py") == 2, "both commands are recorded"


def test_real_models_smoke_runs_the_models_as_users_configure_them(tmp_path):
    """Issue 31's rows: Llama with its config's defaults, ConvNeXt-T, a ViT-B/16 with drop_path_rate 0.1 (BEiT's
    where timm is not installed), t5-base's and bart-base's shapes, each under eager, a full compile and regional."""
    out = tmp_path / "configured.json"
    models = ["llama_default", "convnext_tiny", "vit_drop_path", "t5_base", "bart_base"]
    run(
        [
            "--smoke",
            "--models",
            *models,
            "--variants",
            "eager",
            "torch_compile",
            "--policies",
            "regional",
            "--out",
            str(out),
        ]
    )
    rows = {(row["model"], row["variant"]): row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == [(m, v) for m in models for v in ("eager", "torch_compile", "policy_regional")]
    for (model, _), row in rows.items():
        assert "error" not in row, row
        assert row["flops_per_step"] > 0 and row["recompiles"] == 0 and row["items_per_s"] > 0, row
        # drop path draws random numbers: the same losses only where nothing random runs
        assert row["loss_rel_diff_vs_eager"] < (1e-2 if model == "vit_drop_path" else 1e-4), row
    timm = importlib.util.find_spec("timm") is not None
    assert rows[("vit_drop_path", "eager")]["source"].startswith("timm" if timm else "transformers Beit")
    assert rows[("t5_base", "eager")]["source"] == "transformers T5ForConditionalGeneration"
    assert rows[("bart_base", "eager")]["source"] == "transformers BartForConditionalGeneration"
