"""The GPU overhead benchmark's CPU smoke mode, run without hydra/omegaconf/wandb as on the GPU image."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_CONFIG_PACKAGES = (
    "import runpy, sys\n"
    "for name in ('hydra', 'omegaconf', 'wandb'):\n"
    "    sys.modules[name] = None  # importing them now fails, as where they are not installed\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_telemetry_overhead_smoke_writes_its_results(tmp_path):
    out = tmp_path / "overhead.json"
    script = ["benchmarks/telemetry_overhead.py", "--smoke", "--out", str(out)]
    command = [sys.executable, "-c", WITHOUT_CONFIG_PACKAGES, *script]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "overhead" in result.stdout and "telemetry on" in result.stdout
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["device"] == "cpu"
    assert len(data["window_step_times_s"]["off"]) == len(data["window_step_times_s"]["on"]) == 2
    assert data["step_time_off_s"] > 0 and data["step_time_on_s"] > 0 and data["hook_host_us_per_step"] > 0
    summary = data["telemetry_summary"]
    assert summary["compile_steps"] == 1 and summary["steady_steps"] == 2 + 2 * 3
    assert summary["steady_items_per_s"] > 0 and summary["flops_per_step"] > 0
