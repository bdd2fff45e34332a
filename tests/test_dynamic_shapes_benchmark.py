"""The dynamic-shapes GPU benchmark's CPU smoke mode, run without hydra/omegaconf/wandb as on the GPU image."""

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


def test_dynamic_shapes_smoke_runs_every_variant_side_by_side(tmp_path):
    out = tmp_path / "dynamic_shapes.json"
    variants = "plain,dynamic,buckets,regional_dynamic,regional_buckets"
    script = ["benchmarks/dynamic_shapes.py", "--smoke", "--variants", variants, "--out", str(out)]
    command = [sys.executable, "-c", WITHOUT_CONFIG_PACKAGES, *script]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup_vs_plain" in result.stdout, "the side-by-side table is printed"
    data = json.loads(out.read_text())
    rows = {row["variant"]: row for row in data["rows"]}
    assert list(rows) == variants.split(",")
    assert all(row["total_s"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["plain"]["graphs"] == 2 and rows["plain"]["recompiles"] == 1, "static, then automatic dynamic"
    assert rows["dynamic"]["graphs"] == 1 and rows["regional_dynamic"]["graphs"] == 3, "one per compiled entry"
    assert rows["buckets"]["graphs"] <= 2 and rows["buckets"]["padding"] > 0, "two buckets: 32 and 64"
    assert rows["regional_buckets"]["graphs"] <= 2 * 3
    assert rows["dynamic"]["padding"] == 0 and rows["plain"]["speedup_vs_plain"] == 1
