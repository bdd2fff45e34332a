"""The GPU overhead benchmark's CPU smoke mode, run without hydra/omegaconf/wandb as on the GPU image."""

import json

from tests.benchmark_smoke import run_without_config_packages


def test_telemetry_overhead_smoke_writes_its_results(tmp_path):
    out = tmp_path / "overhead.json"
    result = run_without_config_packages(["benchmarks/telemetry_overhead.py", "--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert "error" not in row, row["error"]
    assert "overhead_percent" in result.stdout and data["meta"]["device"].startswith("CPU")
    assert row["model"] == "tiny" and row["batch_size"] == 4
    assert len(row["window_step_times_s"]["off"]) == len(row["window_step_times_s"]["on"]) == 2
    assert row["step_time_off_s"] > 0 and row["step_time_on_s"] > 0 and row["hook_host_us_per_step"] > 0
    summary = row["telemetry_summary"]
    assert summary["compile_steps"] == 1 and summary["steady_steps"] == 2 + 2 * 3
    assert summary["steady_items_per_s"] > 0 and summary["flops_per_step"] > 0
    assert row["tokens_per_s"] == summary["steady_items_per_s"]
