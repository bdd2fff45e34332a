"""The vision benchmark's CPU smoke mode, as on the GPU image (without hydra, omegaconf or wandb): timm models as their
recipes build them, trained through Lightning under the policies, rows with the callback's own figures beside the
benchmark's clock, and ``--profile``'s report of one steady step. The tier ``vision``: it needs timm."""

import gzip
import json

from tests.benchmark_smoke import run_without_config_packages


def test_vision_smoke_measures_the_policies_and_profiles_a_steady_step(tmp_path):
    import timm  # noqa: F401  (a missing timm fails the test, it does not skip it; not at collection: see conftest)

    out = tmp_path / "vision.json"
    script = ["benchmarks/vision.py", "--smoke", "--models", "vit_base_patch16_224", "--variants"]
    script += ["regional,reduce_overhead", "--profile", "vit_base_patch16_224:regional", "--out", str(out)]
    result = run_without_config_packages(script, timeout=600)
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["regional", "reduce_overhead", "regional (profile)"], rows
    assert all(row["error"] is None for row in rows.values()), rows
    regional, whole = rows["regional"], rows["reduce_overhead"]
    for row in (regional, whole):
        assert row["first_step_s"] > 0 and row["images_per_s"] > 0 and row["summary_first_step_s"] > 0
        assert row["summary_images_per_s"] > 0 and row["summary_vs_own"] > 0, "images/s of (x, y) batches"
        assert row["recompiles"] == 0 and row["steps"] >= 5
    assert whole["throughput_vs_full"] == 1 and whole["first_step_vs_full"] == 1
    assert regional["throughput_vs_full"] == regional["images_per_s"] / whole["images_per_s"]
    # on a CPU nothing compiles in the background: the 6 blocks' 2 structures (block 0 has no drop path) at the first
    # step; the tiny ViT's 1000-class head holds more than 10% of its weights: compiled around the blocks
    assert regional["plan"] == "6 blocks in 2 entries (2 at the first step), 0 rest (0 in the background), 1 outer"
    assert regional["background_eager_steps"] is None and whole["plan"] == "full"
    profile = rows["regional (profile)"]["profile"]
    assert profile["top"] and all(entry["ms"] >= 0 for entry in profile["top"])
    assert profile["compiled_calls"] > 0 and "layout conversions" in result.stdout
    with gzip.open(profile["trace"]) as trace:
        assert json.load(trace)["traceEvents"]
    assert rows["regional (profile)"]["plan"] == regional["plan"] and profile["step_ms"] is None  # no GPU kernels
