"""The GPU overhead benchmark's CPU smoke mode, run without hydra/omegaconf/wandb as on the GPU image."""

import json

from tests.benchmark_smoke import run_without_config_packages


def test_telemetry_overhead_smoke_writes_its_results(tmp_path):
    out = tmp_path / "overhead.json"
    script = ["benchmarks/telemetry_overhead.py", "--smoke", "--out", str(out)]
    result = run_without_config_packages(script)
    assert "overhead" in result.stdout and "telemetry on" in result.stdout
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["device"] == "cpu"
    assert len(data["window_step_times_s"]["off"]) == len(data["window_step_times_s"]["on"]) == 2
    assert data["step_time_off_s"] > 0 and data["step_time_on_s"] > 0 and data["hook_host_us_per_step"] > 0
    summary = data["telemetry_summary"]
    assert summary["compile_steps"] == 1 and summary["steady_steps"] == 2 + 2 * 3
    assert summary["steady_items_per_s"] > 0 and summary["flops_per_step"] > 0
