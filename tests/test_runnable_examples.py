"""The runnable examples in docs/examples, as a newcomer runs them (short, with aot_eager: the plan and telemetry
are the same as under Inductor, the compiles take seconds)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, f"docs/examples/{name}", "--backend", "aot_eager", "--out", str(tmp_path), *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def final_line(result: subprocess.CompletedProcess) -> dict:
    """The example's last line, ``name value`` pairs (``train/loss 2.1``, ``3 recompiles``) as a dict."""
    line = result.stdout.strip().splitlines()[-1]
    values = {name: float(value) for name, value in re.findall(r"([a-z/]+) (\d+\.?\d*)", line)}
    values |= {name: float(value) for value, name in re.findall(r"(\d+) (recompiles|graph breaks)", line)}
    return values


def test_the_causal_lm_example_trains_a_hugging_face_decoder_on_variable_lengths(tmp_path):
    result = run_example(
        "hf_causal_lm.py", tmp_path, "--steps", "30", "--text-bytes", "300000", "--layers", "2", "--hidden", "64"
    )
    output = result.stdout + result.stderr
    assert "compile policy 'dynamic'" in output and "regional block" in output
    assert "the training forwards of model.model run without one" in output, "its config's KV cache, handled"
    values = final_line(result)
    assert values["train/loss"] < 4.5 and values["val/loss"] < 4.5, values  # from ln(256) = 5.5 at the start
    assert values["graph breaks"] == 0
    assert values["recompiles"] == 0, output[-3000:]  # every length on the blocks' first graph
    assert re.search(r"\d[\d,]* tokens/s \([\d,]+ with padding\)", output), "real tokens/s, from the attention mask"


def test_the_vision_example_trains_a_convnext_with_stochastic_depth_regionally(tmp_path):
    result = run_example("vision_classifier.py", tmp_path, "--steps", "40", "--images", "512")
    output = result.stdout + result.stderr
    assert "18 regions, 5 compiled entries" in output, "the blocks inside the stages, one graph per stage"
    assert "differ only in the floats drop_path.drop_prob: one graph" in output
    assert "no trial trace" not in output, "stochastic depth alone needs no trial trace"
    values = final_line(result)
    assert values["recompiles"] == 0 and values["graph breaks"] == 0, output[-3000:]
    assert 0 <= values["val/acc"] <= 1
