"""The variable-length HF Llama GPU benchmark's CPU smoke mode: every variant side by side (in one process)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hf_varlen_smoke_runs_the_policies_side_by_side(tmp_path):
    out = tmp_path / "hf_varlen.json"
    variants = ["dynamic", "dynamic_full", "dynamic_full_background", "buckets_auto", "fixed_length"]
    command = [sys.executable, "benchmarks/hf_varlen.py", "--smoke", "--out", str(out), "--variants", *variants]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vs_fixed_length" in result.stdout, "the side-by-side table is printed"
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants and not any("error" in row for row in rows.values()), rows
    auto = rows["buckets_auto"]
    assert len(auto["buckets"]) == 4 and auto["buckets"][-1] <= 64
    # the first batch exactly as long as its bucket: HF drops the all-ones mask, and the blocks' path without a mask
    # compiles once (warm-up then compiles it at the other buckets)
    assert auto["recompiles_after_warmup"] == 1, auto["recompile_reasons"]
    assert rows["fixed_length"]["padding"] == 0 and rows["fixed_length"]["vs_fixed_length"] == 1
    assert rows["dynamic"]["buckets"] is None and rows["dynamic"]["steady_real_tokens_per_s"] > 0
    full = rows["dynamic_full"]  # one graph, lengths padded to multiples of 64 (the smoke stream's longest is 64)
    assert full["graphs"] == 1 and full["recompiles_after_warmup"] == 0 and full["steady_compiles"] == 0
    assert full["padding"] > 0 and full["steady_steps"] > 0
    background = rows["dynamic_full_background"]  # eager first steps while a thread compiles, then the same graph
    assert background["background"]["background_eager_steps"] >= 1 and background["graphs"] == 1
    assert background["steady_compiles"] == 0 and background["first_step_s"] > 0


def test_hf_varlen_smoke_with_the_compiled_optimizer_step_and_another_padding_multiple(tmp_path):
    out = tmp_path / "hf_varlen.json"
    variants = ["fixed_length", "dynamic_full_background"]
    command = [sys.executable, "benchmarks/hf_varlen.py", "--smoke", "--optimizer", "compiled", "--out", str(out)]
    command += ["--pad-multiple", "16", "--variants", *variants]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AdamW with compile_optimizer's step (every variant)" in result.stdout
    assert "the policies' lengths padded to multiples of 16 (--pad-multiple)" in result.stdout
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants and not any("error" in row for row in rows.values()), rows
    for row in rows.values():  # the stream's steps, its steady pass's and warm-ups': all but the first compiled
        steps = row["optimizer_steps"]
        assert steps["own"] == 1 and steps["compiled"] >= row["steps"] + row["steady_steps"] - 1, steps
    assert rows["dynamic_full_background"]["steady_compiles"] == 0
    # the smoke stream's lengths (8..64) padded to 16, not the policy's own 64; the reference is not padded
    seen = {length for length, *_ in rows["dynamic_full_background"]["step_ms"]}
    assert all(length % 16 == 0 for length in seen) and min(seen) < 64, seen
    assert rows["fixed_length"]["padding"] == 0
