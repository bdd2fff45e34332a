"""The GPU benchmarks' code cannot rot: their CPU smoke mode runs here, and the report regenerates."""

import json

from tests.benchmark_smoke import ROOT, run_without_config_packages


def test_train_step_smoke_compares_variants_side_by_side(tmp_path):
    out = tmp_path / "train_step.json"
    variants = ["eager", "torch_compile", "policy_regional", "lightning_full"]
    result = run_without_config_packages(
        ["benchmarks/train_step.py", "--smoke", "--out", str(out), "--variants", *variants]
    )
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants and not any("error" in row for row in rows.values()), rows
    assert rows["eager"]["graphs"] == 0 and rows["policy_regional"]["graphs"] == 3
    for row in rows.values():
        assert row["first_step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["loss_rel_diff_vs_eager"] < 1e-4, "every variant trains the same model on the same data"
    assert rows["torch_compile"]["throughput_vs_torch_compile"] == 1.0
    assert "lightning_full" in result.stdout


def test_benchmarks_page_regenerates_from_the_result_files(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    run_without_config_packages(["benchmarks/make_report.py", "--out", str(page)])
    text = page.read_text()
    for result in (ROOT / "benchmarks" / "results").rglob("*.json"):
        if result.name not in ("result.json", "experiment.json"):  # a sweep's files: one section, named by its folder
            assert result.relative_to(ROOT).as_posix() in text
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)), "no two sections share a heading"
    assert text.index("## Headlines") < text.index("## Experiments")
    assert "NVIDIA H100" in text and "torch 2.11" in text and "command: `python benchmarks/" in text
    assert (tmp_path / "train_step.png").stat().st_size > 10_000
