"""The compile-cache GPU benchmark's CPU smoke mode, as on the GPU image (no hydra, no wandb): a cold phase that
writes the bundle and a new machine that loads it, each a fresh process, rows in the result file."""

import json

import pytest

from compile_trainer import compat
from tests.benchmark_smoke import run_without_config_packages


def test_compile_cache_smoke_writes_cold_and_new_machine_rows(tmp_path):
    out = tmp_path / "compile_cache.json"
    script = ["benchmarks/compile_cache.py", "--smoke", "--models", "gpt2_small", "--policies", "regional"]
    phases = ["--phases", "cold", "new_machine", "eager"]
    run_without_config_packages([*script, *phases, "--out", str(out)], timeout=400)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "compile_cache" and data["notes"] and "torch" in data["meta"]
    rows = {row["phase"]: row for row in data["rows"]}
    assert list(rows) == ["cold", "new_machine", "eager"]
    cold, warm, eager = rows["cold"], rows["new_machine"], rows["eager"]
    assert cold["cache"].startswith("miss") and cold["bundle_mb"] > 0
    assert warm["cache"] == "hit" and warm["fx_graph_hit_miss"].endswith("/0")
    assert warm["vs_cold"] == pytest.approx(warm["first_step_s"] / cold["first_step_s"])
    assert cold["compiles"] > 0 and eager["compiles"] == 0
    assert warm["loss_rel_diff_vs_cold"] < 1e-5  # the same compiled code (CPU kernels are deterministic)
    assert warm["compiler_import_s"] > 0
    if compat.aot_compile_problem() is None:  # every region served by the precompiled layer: nothing traced
        hits, misses = map(int, warm["precompiled_hit_miss"].split("/"))
        assert hits > 0 and misses == 0 and warm["compiles"] == 0
        assert warm["compile_s"] == warm["dynamo_s"] == warm["backend_s"] == 0
    else:  # traced again, the backend's work from the bundle's cache files
        assert warm["compiles"] == cold["compiles"]
    assert abs(warm["run_s"] + warm["compile_s"] + warm["load_s"] - warm["first_step_s"]) < 1e-6
    assert eager["compile_s"] == 0 and eager["cache"] == "off"
