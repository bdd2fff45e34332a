"""The dynamic-shapes GPU benchmark's CPU smoke mode, run without hydra/omegaconf/wandb as on the GPU image."""

import json

from tests.benchmark_smoke import run_without_config_packages


def test_dynamic_shapes_smoke_runs_every_variant_side_by_side(tmp_path):
    out = tmp_path / "dynamic_shapes.json"
    variants = "plain,dynamic,buckets,regional_dynamic,regional_buckets"
    script = ["benchmarks/dynamic_shapes.py", "--smoke", "--variants", variants, "--out", str(out)]
    result = run_without_config_packages(script)
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
