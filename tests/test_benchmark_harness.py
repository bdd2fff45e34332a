"""The benchmarks' harness (benchmarks/common.py): a variant in a fresh process with compile caches of its own, the
result file's commit, repeats and ratios, and how make_report.py renders a headline and a former headline."""

import json
import subprocess
import textwrap

import pytest

from benchmarks import common
from tests.benchmark_smoke import ROOT, run_without_config_packages

# A worker as a benchmark script writes one: what the fresh process sees, through the harness's worker().
WORKER = textwrap.dedent(
    """
    import argparse, os, sys
    from pathlib import Path

    from benchmarks.common import worker
    from compile_trainer import compat

    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--sleep", type=float, default=0)
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--worker-out", type=Path)
    args = parser.parse_args()
    if args.partial:
        args.worker_out.write_text('{"first_step_s": 1')
    if args.fail or args.partial:
        sys.exit("the variant failed on purpose")
    if args.sleep:
        import time

        time.sleep(args.sleep)
    inductor = compat.inductor_cache_dir()
    found = sorted(os.listdir(inductor)) if os.path.isdir(inductor) else []
    Path(inductor).mkdir(parents=True, exist_ok=True)
    (Path(inductor) / "compiled").write_text("a kernel")  # what a compile leaves for the next process to find
    worker(args.worker_out, lambda: {
        "inductor": inductor, "triton": os.environ["TRITON_CACHE_DIR"], "found": found,
        "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep),
    })
    """
)


def test_each_variant_runs_in_a_fresh_process_with_empty_caches_of_its_own(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")  # where the GPU machine installs its wheels
    first, second = (common.run_fresh(str(script), [], timeout=120) for _ in range(2))
    assert "error" not in first and "error" not in second, (first, second)
    assert first["found"] == second["found"] == [], "each process starts with an empty Inductor cache"
    assert first["inductor"] != second["inductor"] and first["triton"] != second["triton"]
    assert first["pythonpath"] == [str(ROOT), "/tmp/site"]

    machine = tmp_path / "machine"  # caches given: they outlive the process, the next one finds them
    common.run_fresh(str(script), [], timeout=120, caches=machine)
    again = common.run_fresh(str(script), [], timeout=120, caches=machine)
    assert again["found"] == ["compiled"] and again["inductor"] == str(machine / "inductor")

    log = tmp_path / "errors.log"
    failed = common.run_fresh(str(script), ["--fail"], timeout=120, log=log)
    assert failed["error"].startswith("exit code 1 |") and "failed on purpose" in failed["error"]
    assert "failed on purpose" in log.read_text() and set(failed) == {"error"}, "a failed run's row: its error"
    partial = common.run_fresh(str(script), ["--partial"], timeout=120)  # a row cut while being written
    assert partial["error"].startswith("exit code 1 |") and set(partial) == {"error"}
    slow = common.run_fresh(str(script), ["--sleep", "30"], timeout=3)
    assert slow["error"].startswith("timed out after 3 s") and set(slow) == {"error"}


def test_the_result_file_records_the_commit_and_a_dirty_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "file.txt").write_text("one")
    subprocess.run([*git, "add", "file.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(common, "ROOT", repo)
    out = tmp_path / "result.json"
    common.write_result(out, "bench", "A benchmark", ["variant"], [{"variant": "eager"}], ["a note"])
    meta = json.loads(out.read_text())["meta"]
    assert meta["commit"] == head and meta["torch"] and "lightning" in meta and "transformers" in meta
    (repo / "file.txt").write_text("two")
    assert common.git_commit() == f"{head}-dirty"
    monkeypatch.setattr(common, "ROOT", tmp_path / "not_a_repo")
    (tmp_path / "not_a_repo").mkdir()
    assert common.git_commit() is None, "no repository: no commit, no failure"


def test_ratios_repeats_and_the_side_by_side_table(capsys):
    runs = [{"step_ms": 10.0, "first_step_s": 3.0}, {"step_ms": 12.0, "first_step_s": 1.0}, {"error": "crashed"}]
    runs.append({"step_ms": 11.0, "first_step_s": 2.0})
    merged = common.repeated(runs, ["step_ms", "first_step_s"])
    assert merged["step_ms"] == 11.0 and merged["spread"]["step_ms"] == [10.0, 12.0] and merged["repeats"] == 3
    assert common.repeated([{"error": "x"}, {"error": "y"}], ["step_ms"]) == {"error": "x"}

    rows = [
        {"model": "a", "variant": "eager", "step_ms": 20.0},
        {"model": "a", "variant": "compiled", "step_ms": 10.0},
        {"model": "b", "variant": "eager", "step_ms": 40.0},
        {"model": "b", "variant": "compiled", "step_ms": 50.0},
        {"model": "c", "variant": "compiled", "step_ms": 5.0},  # no baseline of its model: no ratio
        {"model": "a", "variant": "broken", "error": "failed"},
    ]
    common.add_ratio(rows, "speedup_vs_eager", "step_ms", lambda r: r["variant"] == "eager", lambda r: r["model"], True)
    assert [row.get("speedup_vs_eager") for row in rows] == [1.0, 2.0, 1.0, 0.8, None, None]
    common.print_table(["model", "variant", "step_ms", "speedup_vs_eager"], rows, baseline="eager")
    printed = capsys.readouterr().out
    assert "speedup_vs_eager" in printed and "0.8" in printed and "against eager" in printed
    assert common.rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1) and common.rel_diff([], []) is None


def test_every_script_s_command_line_shares_the_harness_s_flags():
    bench = common.Benchmark(
        "bench", "A benchmark", ["variant"], runs=lambda args: [], measure=lambda args: {},
        shared=dict(steps=200, variant_timeout=300), options={"--batch": dict(type=int, default=8)},
        smoke=dict(steps=3, batch=2),
    )  # fmt: skip
    args = common.parse(bench, "a benchmark", ["--append"])
    assert args.out == common.RESULTS / "bench.json" and args.append and not args.smoke and args.worker_out is None
    assert common.parse(bench, None, ["--out", "x.json"]).out.name == "x.json", "the headline's file, or --out"
    shared = common.parse(bench, None, ["--steps", "5"])
    assert shared.steps == 5 and shared.variant_timeout == 300, "the shared flags: given, or the script's default"
    args = common.parse(bench, "a benchmark", ["--worker", '{"variant": "eager", "_cache": "x"}'])
    assert (args.steps, args.batch, args.worker) == (200, 8, {"variant": "eager", "_cache": "x"})
    assert common.run_args(args, args.worker).variant == "eager" and args.cache == "x", "a run's fields, _ dropped"
    smoke = common.parse(bench, "a benchmark", ["--smoke", "--batch", "4"])
    assert (smoke.steps, smoke.batch) == (3, 4), "--smoke's defaults; a flag given still wins"


def test_a_training_run_s_steps_each_run_once_in_order():
    """The first step, eager steps while a background compile is not in use, the warm-up, then the timed ones."""
    seen = []
    times = common.first_warm_timed(common.device_for(True), seen.append, 3, 4, lambda: len(seen) < 3, max_eager=10)
    assert seen == list(range(9)), "0, eager 1-2, warm-up 3-4, timed 5-8"
    assert set(times) == {"first_step_s", "step_s", "slowest_step_s", "window_s"}
    seen.clear()
    times = common.first_warm_timed(common.device_for(True), seen.append, 1, 2)
    assert seen == [0, 1, 2], "no warm-up after the first step: timed from 1"


def test_the_report_shows_a_headline_s_commit_and_repeats_and_a_former_headline_s_change(tmp_path):
    results = tmp_path / "results"
    row = {"variant": "compiled", "step_ms": 11.0, "repeats": 3, "spread": {"step_ms": [10.0, 12.0]}}
    meta = {"device": "NVIDIA H100", "torch": "2.11", "date": "2026-11-25", "command": "python x.py"}
    meta["commit"] = "abc1234"
    headline = {"benchmark": "x", "title": "X headline", "meta": meta, "columns": ["variant", "step_ms"]}
    (results / "experiments").mkdir(parents=True)
    once = {"variant": "by_hand", "step_ms": 12.5}  # a row measured once among repeated ones
    failed = {"variant": "nested", "error": "InductorError: ..."}  # a failed run: no figure to repeat
    (results / "x.json").write_text(json.dumps(headline | {"rows": [row, once, failed], "notes": []}))
    old = headline | {"rows": [{"variant": "compiled", "step_ms": 9.0}], "notes": [], "meta": meta | {"commit": None}}
    (results / "y.json").write_text(json.dumps(old | {"title": "Y headline"}))
    former = old | {"experiment": "X as it was", "changed_since": "regional's rest became auto"}
    (results / "experiments" / "x_before.json").write_text(json.dumps(former))
    page = tmp_path / "BENCHMARKS.md"
    run_without_config_packages(["benchmarks/make_report.py", "--results", str(results), "--out", str(page)])
    text = page.read_text()
    x, y = text.index("### X headline"), text.index("### Y headline")
    assert (
        "Commit `abc1234`. Timings and ratios are medians over 3 fresh runs a row (1 row without `repeats`: one run"
        in text[x:y]
    )
    assert "1 row failed: the error column says why." in text[x:y]
    assert "Commit not recorded. Single run, no spread." in text[y : text.index("## Experiments")]
    former_section = text[text.index("### X as it was") :]
    assert "what changed since:** regional's rest became auto" in former_section
    assert "Commit" not in former_section, "only headlines state their commit"


@pytest.mark.parametrize(
    "compile_id, recompile",
    [("0/0", False), ("3/1", True), ("[2/1]", True), ("!0/3/0", False), ("!0/3/1", True)],
)
def test_a_recompile_is_read_from_the_compile_id_as_the_telemetry_reads_it(compile_id, recompile):
    """Compiled autograd's ids carry a prefix ("!0/3/0": frame 3, first attempt), which is no recompile."""
    metric = type("Metric", (), {"compile_id": compile_id})()
    assert common.is_recompile(metric) is recompile
