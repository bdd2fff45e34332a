"""``compile-trainer report`` on hand-made result files: payback, flags, partial sweeps, bad input."""

import math
import re

import pytest

from compile_trainer.cli.main import EXIT_BAD_INPUT
from compile_trainer.cli.main import main as cli_main
from compile_trainer.runs.recorder import sweeper_value
from compile_trainer.runs.report import build_report
from compile_trainer.runs.report_plot import plot_report
from compile_trainer.runs.report_tables import repeat_rows, report_text
from compile_trainer.runs.results import objective_value, write_result
from compile_trainer.schema import SettingsError, to_sweep_settings

TOKENS_PER_STEP = 1000


def write_run(
    directory,
    job,
    policy,
    *,
    step=0.1,
    compile_s=0.0,
    compile_steps=0,
    loss=2.0,
    steps=100,
    cache=None,
    unit=None,
    **extra,
):
    """A result file like train.py writes: ``steps`` steps, the compile steps taking ``compile_s`` more each;
    ``cache``: the compile cache's summary keys; ``unit``: what its throughput counts (the telemetry's)."""
    steady = steps - compile_steps
    result = {
        "status": "ok",
        "error": None,
        "policy": policy,
        "policy_settings": {"name": policy, "enabled": policy != "none", "optimizer": {"compile": "false"}},
        "overrides": [f"compile={policy}"],
        "sweep": {"name": "hand_made", "dir": str(directory), "job": job},
        "summary": {
            "compile_time_s": compile_s,
            "recompiles": 0,
            "grad_mode_variants": 0,
            "graph_breaks": 0,
            "compile_steps": compile_steps,
            "compile_steps_time_s": compile_steps * (step + compile_s),
            "steady_steps": steady,
            "steady_step_time_s": step,
            "steady_items_per_s": TOKENS_PER_STEP / step,
            "peak_memory_bytes": 2**30,
            **(cache or {}),
            **({"items_unit": unit} if unit else {}),
        },
        "final_train_loss": loss,
        "final_val_loss": loss,
        "seed": 0,
        "steps": steps,
        "recipe": "gpt_tiny",
        "data": {"block_size": 32},
        "model": {"n_layer": 2},
        "precision": "bf16-mixed",
        "fresh_cache": True,
        "environment": {"device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}, "versions": {"torch": "2.11.0"}},
        **extra,
    }
    write_result(directory / str(job), result)


@pytest.fixture
def sweep_dir(tmp_path):
    write_run(tmp_path, 0, "none", step=0.1)
    write_run(tmp_path, 1, "full", step=0.05, compile_s=10.0, compile_steps=1)
    write_run(tmp_path, 2, "regional", step=0.12, compile_s=2.0, compile_steps=1)
    write_run(tmp_path, 3, "max_autotune", step=0.04, compile_s=60.0, compile_steps=1, loss=2.2)
    write_run(tmp_path, 4, "reduce_overhead", step=0.045, compile_s=5.0, compile_steps=1, steps=50)
    hydra_dir = tmp_path / "5" / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "overrides.yaml").write_text("- compile=buckets\n")
    return tmp_path


def report_rows(text):
    """The report table's rows by policy label, as lists of cells."""
    lines = [re.split(r"\s{2,}", line) for line in text.splitlines() if re.match(r"\d+  ", line)]
    return {cells[1]: cells for cells in lines}


def test_payback_loss_check_unequal_runs_and_a_run_without_result(sweep_dir, capsys):
    assert cli_main(["report", str(sweep_dir), "--no-plot"]) == 0
    text = capsys.readouterr().out
    rows = report_rows(text)
    assert [rows[p][0] for p in ("max_autotune", "reduce_overhead", "full", "none", "regional", "buckets")] == [
        "1", "2", "3", "4", "5", "6"
    ]  # fmt: skip
    # full: 10 s more in its compile step, 0.05 s saved per step -> even with none after 200 steps
    assert rows["full"][7:9] == ["2.00x", "200"]
    assert rows["regional"][7:9] == ["0.83x", "never"]
    assert rows["none"][7:9] == ["1.00x", "-"]
    assert rows["max_autotune"][13:] == ["2.2000", "+10.00%"]
    assert rows["buckets"][2] == "no result" and set(rows["buckets"][3:]) == {"-"}
    assert "6 runs, 5 ok, 0 failed, 1 without a result" in text
    assert re.search(r"max_autotune: final loss 2\.2000 is \+10\.0% off none's 2\.0000 \(tolerance 2%\)", text)
    assert "reduce_overhead: not comparable with none: steps 50 vs 100" in text
    assert "buckets: no result file: still running, or killed" in text
    assert "Equal comparison: NO, 1 run(s) differ" in text
    assert "Device: NVIDIA H100 80GB HBM3; torch 2.11.0" in text
    assert "Recommendation: full (best throughput: 20,000 tokens/s; 2.00x the baseline's steady throughput; " in text
    assert "pays off after 200 steps; ranked higher but flagged: max_autotune, reduce_overhead)." in text


def test_runs_that_differ_only_in_seed_are_repeats_compared_seed_by_seed(tmp_path, capsys):
    """``-m compile=none,full,regional seed=0,1``: each run against its own seed's baseline and data (no flag for
    the seed), a table of medians with their spread, and the recommendation from the medians. Seed 1 runs
    everything 25% slower (another host, say): ratios stay those of the seed."""
    job = 0
    for seed, slower in ((0, 1.0), (1, 1.25)):
        for policy, step in (("none", 0.1), ("full", 0.05), ("regional", 0.04)):
            overrides = [f"compile={policy}", f"seed={seed}"]
            data = {"block_size": 32, "seed": seed}
            write_run(tmp_path, job, policy, step=step * slower, seed=seed, overrides=overrides, data=data)
            job += 1
    assert cli_main(["report", str(tmp_path), "--no-plot"]) == 0
    text = capsys.readouterr().out
    rows = report_rows(text)
    assert rows["regional seed=1"][7] == rows["regional seed=0"][7] == "2.50x", "against its own seed's baseline"
    assert "not comparable" not in text and "Equal comparison: yes" in text and "seeds 0, 1" in text
    repeats = text.split("Over the seeds (medians):")[1].splitlines()
    regional = next(re.split(r"\s{2,}", line) for line in repeats if line.startswith("regional"))
    # 1000 tokens a step: 25,000 and 20,000 tokens/s, median 22,500
    assert regional[:6] == ["regional", "2/2", "0.0", "22,500", "20,000-25,000", "2.50x"]
    assert "Recommendation: regional (best median throughput over 2 seeds: 22,500 tokens/s; 2.50x" in text


def test_the_table_over_seeds_ranks_settings_as_the_objective_says(tmp_path):
    """A lower-is-better objective (compile time) puts the setting that compiles least first, as its recommendation."""
    runs = [(0, "full", 9.0), (0, "regional", 2.0), (1, "full", 8.0), (1, "regional", 3.0)]
    for job, (seed, policy, compile_s) in enumerate(runs):
        overrides = [f"compile={policy}", f"seed={seed}"]
        settings = dict(seed=seed, data={"block_size": 32, "seed": seed}, overrides=overrides)
        write_run(tmp_path, job, policy, compile_s=compile_s, compile_steps=1, **settings)
    report = build_report(tmp_path, objective="compile_time")
    assert [row[0] for row in repeat_rows(report)] == ["regional", "full"]
    assert report.recommendation().startswith("Recommendation: regional (best median compile_time over 2 seeds: 2.5 s")


def test_a_seed_without_its_own_baseline_is_compared_with_the_sweeps(tmp_path):
    write_run(tmp_path, 0, "none", overrides=["compile=none", "seed=0"])
    write_run(tmp_path, 1, "full", step=0.05, seed=1, data={"block_size": 32, "seed": 1}, overrides=["compile=full"])
    report = build_report(tmp_path)
    full = next(run for run in report.runs if run.policy == "full")
    assert report.speedup(full) == pytest.approx(2.0)
    assert any(flag.startswith("not comparable with none seed=0: seed 1 vs 0") for flag in full.flags), full.flags


def test_loss_tolerance_and_objective_change_the_verdict(sweep_dir, capsys):
    report = build_report(sweep_dir, objective="train_time", loss_tolerance=0.2)
    assert not any("final loss" in flag for run in report.runs for flag in run.flags)
    # 100 steps: none 10 s, full 10 + 5 s, regional 2 + 12 s, max_autotune 60 + 4 s; reduce_overhead ran 50 steps
    ranked = [run.label for run in report.ranked]
    assert ranked == ["reduce_overhead", "none", "regional", "full", "max_autotune", "buckets"]
    assert report.recommendation().startswith("Recommendation: none (best train_time: 10.0 s; no compiled policy")
    assert cli_main(["report", str(sweep_dir), "--objective", "memory", "--no-plot", "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| 1 | none | ok | 0.0 | - | - | 10,000 | 1.00x | - | 0 | 0 | 0 | 1.00 | 2.0000 | +0.00% |" in markdown


def test_cold_and_warm_compiles_are_shown_apart(tmp_path, capsys):
    """A run that loaded a compile-cache bundle shows its own (warm) compile and the bundle's cold compile."""
    write_run(tmp_path, 0, "none")
    cold = {"cache_status": "miss"}
    write_run(tmp_path, 1, "regional", compile_s=12.0, compile_steps=1, cache=cold, overrides=["seed=1"])
    warm = {"cache_status": "hit", "cache_cold_compile_s": 12.0}
    write_run(tmp_path, 2, "regional", compile_s=1.5, compile_steps=1, cache=warm, overrides=["seed=2"])
    assert cli_main(["report", str(tmp_path), "--no-plot"]) == 0
    rows = {cells[4]: cells for cells in report_rows(capsys.readouterr().out).values()}
    assert rows["miss"][3:6] == ["12.0", "miss", "12.0"]
    assert rows["hit"][3:6] == ["1.5", "hit", "12.0"]


def test_labels_name_the_overrides_that_vary_and_no_baseline_is_said(tmp_path):
    for job, mode in enumerate(["default", "max-autotune-no-cudagraphs"]):
        write_run(tmp_path, job, "full", overrides=["compile=full", f"compile.mode={mode}", "seed=0"])
    report = build_report(tmp_path)
    assert sorted(run.label for run in report.runs) == ["full mode=default", "full mode=max-autotune-no-cudagraphs"]
    assert report.baseline is None and all(report.speedup(run) is None for run in report.runs)
    assert "no eager baseline" in report_text(report)
    plot = plot_report(report, tmp_path / "plot.png")
    assert plot.stat().st_size > 10_000


def test_a_directory_without_runs_is_bad_input(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "no runs under" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path / "missing")]) == EXIT_BAD_INPUT
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "result.json").write_text('{"status": "ok"}')
    assert cli_main(["report", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "not a compile_trainer result file" in capsys.readouterr().err


def test_value_returned_to_the_sweeper():
    objective = {"name": "throughput", "maximize": True, "value": 5.0, "within_budget": True}
    assert sweeper_value({"objective": objective}) == 5.0
    assert sweeper_value({"objective": {**objective, "within_budget": False}}) == -math.inf
    assert sweeper_value({"objective": {**objective, "maximize": False, "within_budget": False}}) == math.inf
    assert math.isnan(sweeper_value({"objective": {**objective, "value": None}}))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"objective": "speed"}, "sweep.objective='speed' is unknown. Valid objectives: throughput, compile_time"),
        ({"compile_time_budget_s": 0}, "sweep.compile_time_budget_s must be positive"),
    ],
)
def test_bad_sweep_settings_are_named(settings, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        to_sweep_settings(settings)


def test_train_time_counts_every_step_that_trained_the_eager_reference_steps_too():
    summary = dict(compile_steps_time_s=4.0, warmup_steps_time_s=0.5, steady_step_time_s=0.1, steady_steps=20)
    assert objective_value({"summary": summary}, "train_time") == pytest.approx(6.5)
    with_reference = {"summary": summary | {"eager_steps": 5, "eager_steps_time_s": 1.5}}
    assert objective_value(with_reference, "train_time") == pytest.approx(8.0)


@pytest.mark.parametrize("units, named", [(["images", "images"], "images"), (["images", "tokens"], "items")])
def test_the_report_names_the_unit_its_runs_count(tmp_path, units, named):
    """A sweep of a vision model reports images/s; runs that count different things, items/s."""
    for job, (policy, unit) in enumerate(zip(["none", "full"], units)):
        write_run(tmp_path, job, policy, step=0.1 if policy == "none" else 0.05, unit=unit)
    report = build_report(tmp_path)
    text = report_text(report)
    assert f"steady {named}/s" in text and "tokens/s" not in text.replace(f"{named}/s", "")
    assert report.recommendation().startswith(f"Recommendation: full (best throughput: 20,000 {named}/s")
