"""Sweeps end to end: real Hydra multiruns of train.py, real W&B offline runs, the report on their result files."""

import itertools
import re
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from matplotlib import image
from test_report import report_rows
from test_train_script import ROOT, TINY

from compile_trainer.cli.main import main as cli_main
from compile_trainer.runs.hydra_configs import register_configs
from compile_trainer.runs.report import build_report
from compile_trainer.runs.results import RESULT_FILE, read_result
from compile_trainer.runs.wandb_offline import read_offline_run
from compile_trainer.schema import to_policy

STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3"]
BROKEN_POLICY = """\
defaults: [schema, _self_]
name: broken
mode: turbo
rules: [{name: "*", action: full}]
"""


def multirun(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", "-m", *TINY, *STEPS, *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One multirun of four runs; the third has an invalid mode and fails, the fourth runs after it."""
    extra = tmp_path_factory.mktemp("conf")
    (extra / "compile").mkdir()
    (extra / "compile" / "broken.yaml").write_text(BROKEN_POLICY)
    directory = tmp_path_factory.mktemp("sweeps") / "tiny_sweep"
    result = multirun(
        f"hydra.searchpath=[file://{extra}]",
        f"hydra.sweep.dir={directory}",
        "compile=none,full,broken,regional",
        "compile.backend=aot_eager",
    )
    return directory, result


def test_each_run_writes_a_result_and_a_wandb_run_in_the_sweeps_group(sweep):
    directory, process = sweep
    assert process.returncode != 0, "Hydra reports the failed run"
    assert "invalid mode 'turbo'" in process.stderr
    results = {int(path.parent.name): read_result(path) for path in directory.glob(f"*/{RESULT_FILE}")}
    assert sorted(results) == [0, 1, 2, 3]
    assert [results[job]["policy"] for job in range(4)] == ["none", "full", "broken", "regional"]
    assert [results[job]["status"] for job in range(4)] == ["ok", "ok", "failed", "ok"]
    failed = results[2]
    assert failed["error"]["type"] == "PolicyError" and "invalid mode 'turbo'" in failed["error"]["message"]
    for job in (0, 1, 3):
        result = results[job]
        assert result["steps"] == 6 and result["seed"] == 0 and result["recipe"] == "gpt_tiny"
        assert "compile.backend=aot_eager" in result["overrides"] and result["sweep"]["job"] == job
        assert 0 < result["final_train_loss"] < 10 and 0 < result["final_val_loss"] < 10
        assert result["summary"]["steady_items_per_s"] > 0 and result["summary"]["steps"] == 6
        assert result["environment"]["device"]["type"] == "cpu"
        assert result["environment"]["versions"]["torch"].startswith("2.")
    assert results[0]["summary"]["compile_time_s"] == 0
    assert results[1]["summary"]["compile_time_s"] > 0 and results[3]["summary"]["compile_time_s"] > 0

    runs = {run.name: run for run in map(read_offline_run, sorted(directory.glob("*/wandb/offline-run-*")))}
    assert len(runs) == 3, "the failed run never got as far as its logger"
    assert {run.group for run in runs.values()} == {"tiny_sweep"}
    sweep_metric = yaml.safe_load((ROOT / "conf" / "wandb_sweep.yaml").read_text())["metric"]["name"]
    for job in (0, 1, 3):
        run = runs[f"{results[job]['policy']}-gpt_tiny-{job}"]
        assert run.config["compile_policy"]["name"] == results[job]["policy"]
        assert run.config["compile_policy"]["backend"] == "aot_eager"
        assert run.config["run"]["sweep"] == "tiny_sweep" and run.config["run"]["job"] == job
        assert run.summary[sweep_metric] == pytest.approx(results[job]["summary"]["steady_items_per_s"])


def test_report_ranks_the_runs_flags_the_failed_one_and_plots(sweep, tmp_path, capsys):
    directory, _ = sweep
    plot = tmp_path / "plot.png"
    assert cli_main(["report", str(directory), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    rows = report_rows(text)
    assert set(rows) == {"none", "full", "regional", "broken"}
    assert rows["broken"][0] == "4" and rows["broken"][2] == "failed: PolicyError" and set(rows["broken"][3:]) == {"-"}
    assert rows["none"][3] == "0.0" and rows["none"][7] == "1.00x"
    for policy in ("full", "regional"):
        compile_s, tokens_s, speedup = rows[policy][3], rows[policy][6], rows[policy][7]
        assert rows[policy][4:6] == ["-", "-"], "no compile cache: no cache status, no cold compile apart"
        assert float(compile_s) > 0 and float(tokens_s.replace(",", "")) > 0 and speedup.endswith("x")
        assert rows[policy][9] == "0", "validation under no_grad is a grad-mode variant, not a recompile"
        loss_change = float(rows[policy][14].rstrip("%"))
        assert abs(loss_change) < 2, "aot_eager trains like eager"
    throughputs = [float(rows[p][6].replace(",", "")) for p in sorted(rows, key=lambda p: rows[p][0])[:3]]
    assert throughputs == sorted(throughputs, reverse=True), "ranked by steady throughput"
    assert re.search(r"broken: failed: PolicyError: .*invalid mode 'turbo'", text)
    assert "Equal comparison: yes" in text and "seed 0, 6 steps" in text
    assert "Device: CPU" in text and "torch 2." in text and "Recommendation:" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.imread(plot).shape[0] > 300


def test_report_in_markdown_ranked_by_compile_time(sweep, capsys):
    directory, _ = sweep
    assert cli_main(["report", str(directory), "--markdown", "--objective", "compile_time", "--no-plot"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| # | policy | status | compile s | cache | cold compile s | steady tokens/s | vs none")
    assert table[2].startswith("| 1 | none | ok | 0.0 |") and table[-1].startswith("| 4 | broken | failed: PolicyError")
    report = build_report(directory, objective="compile_time")
    compile_times = [run.summary("compile_time_s") for run in report.ranked if run.ok]
    assert compile_times == sorted(compile_times)


def test_optuna_sweep_maximizes_throughput_within_the_compile_time_budget(tmp_path):
    """The bundled Optuna sweep on a grid of 4: only the eager run compiles within a tiny budget, so it wins."""
    process = multirun(
        "+sweep=optuna",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.params.compile='choice(none, full)'",
        f"hydra.sweep.dir={tmp_path}",
        "compile.backend=eager",
        "sweep.compile_time_budget_s=0.001",
        "logger=csv",
    )
    assert process.returncode == 0, process.stderr[-4000:]
    results = [read_result(path) for path in sorted(tmp_path.glob(f"*/{RESULT_FILE}"))]
    assert len(results) == 4 and {r["status"] for r in results} == {"ok"}
    chosen = {(r["policy"], r["policy_settings"]["optimizer"]["compile"]) for r in results}
    assert chosen == {("none", "false"), ("none", "true"), ("full", "false"), ("full", "true")}
    within = [r for r in results if r["objective"]["within_budget"]]
    assert [(r["policy"], r["policy_settings"]["optimizer"]["compile"]) for r in within] == [("none", "false")]
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert best["best_params"] == {"compile": "none", "compile.optimizer.compile": False}
    assert best["best_value"] == pytest.approx(within[0]["objective"]["value"])
    assert within[0]["objective"]["value"] == within[0]["summary"]["steady_items_per_s"]


def sweep_values(spec: str) -> list:
    """The values of a basic-sweeper list (``a,b``) or an Optuna choice (``choice(a, b)``)."""
    match = re.fullmatch(r"choice\((.*)\)", spec)
    return [value.strip() for value in (match.group(1) if match else spec).split(",")]


@pytest.fixture
def hydra_compose():
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield compose


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")))
def test_every_run_of_the_bundled_sweeps_composes_and_validates(hydra_compose, name):
    if name == "dynamic_vs_buckets" and not (ROOT / "conf" / "compile" / "buckets.yaml").is_file():
        pytest.skip("needs the dynamic and buckets policies of issue 5")
    cfg = hydra_compose("config", overrides=[f"+sweep={name}"], return_hydra_config=True)
    assert cfg.sweep.fresh_cache, "each bundled sweep compiles cold"
    assert cfg.hydra.sweep.dir.startswith(f"multirun/{name}_")
    params = {key: sweep_values(str(spec)) for key, spec in cfg.hydra.sweeper.params.items()}
    assert "none" in params["compile"], "every sweep has the eager baseline"
    for values in itertools.product(*params.values()):
        overrides = [f"{key}={value}" for key, value in zip(params, values)]
        run = hydra_compose("config", overrides=[f"+sweep={name}", *overrides])
        assert to_policy(run.compile).name == run.compile.name
        if name == "dynamic_vs_buckets":  # variable-length batches: no CUDA graph per batch shape
            assert run.compile.mode is None


def test_wandb_sweep_yaml_drives_train_py_through_hydra_overrides(hydra_compose):
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    config = yaml.safe_load((ROOT / "conf" / "wandb_sweep.yaml").read_text())
    assert config["program"] == "train.py" and config["metric"]["goal"] == "maximize"
    command = create_sweep_command(config["command"])
    assert command[:3] == ["${env}", "${interpreter}", "${program}"] and command[-1] == "${args_no_hyphens}"
    fixed = [argument for argument in command if "${" not in argument]
    grid = {key: spec["values"] for key, spec in config["parameters"].items()}
    for values in itertools.product(*grid.values()):
        arguments = {key: {"value": value} for key, value in zip(grid, values)}
        overrides = create_sweep_command_args({"args": arguments})["args_no_hyphens"]
        cfg = hydra_compose("config", overrides=[*fixed, *overrides])
        assert cfg.logger.offline is False
        assert to_policy(cfg.compile).optimizer.compile == values[1]
