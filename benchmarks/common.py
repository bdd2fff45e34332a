"""The benchmarks' harness. A script declares a ``Benchmark`` (its runs, the flags it adds, how to measure one run,
its ratios and notes) and calls ``main``: each run in a fresh process with empty Inductor/Triton caches (``run_fresh``;
``worker`` in that process) or in this process with the compiler state reset, the result file (``write_result``)
written after each run, the table (``print_table``) at the end. Also step timing (``StepTimer``,
``first_warm_timed``). Importable without hydra, omegaconf or wandb (the GPU image has none); a run of a bundled
policy reads its YAML file with omegaconf (``to_policy``), so install omegaconf there (with its antlr4 runtime).
"""

import argparse
import datetime
import faulthandler
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from benchmarks.make_report import RESULTS, ROOT, cell
from compile_trainer import compat
from compile_trainer.tables import text_table
from compile_trainer.telemetry.compile_events import split_compile_id
from compile_trainer.telemetry.throughput import table_peak_flops

Rows = List[Dict[str, Any]]

# The flags several benchmarks share: their type and help (a benchmark gives the default).
SHARED_FLAGS = {
    "steps": (int, "steps a variant (timed ones where there is a warm-up)"),
    "warmup": (int, "steps before timing (the first includes compile)"),
    "backend": (str, "compile backend"),
    "timeout": (int, "seconds a variant may take"),
    "variant_timeout": (int, "seconds a variant may take"),
    "repeats": (int, "fresh processes per variant (medians and spread)"),
}


@dataclass
class Benchmark:
    """What a benchmark script declares. ``runs(args)``: one dict per run, its fields the row's first columns and,
    in the worker, attributes of ``args`` (a ``_name`` field goes to the worker only; ``_caches`` also sets the run's
    Inductor/Triton cache folder); ``measure(args)``: the run's row (None: write
    nothing, a distributed job's other ranks); ``finish(rows, args)``: ratios across rows; ``skip(run, args)``: why
    a run cannot run (an error row). ``key``: the fields that name a row (``--append`` keeps the others' rows)."""

    name: str
    title: str
    columns: List[str]
    runs: Callable[[Any], Rows]
    measure: Callable[[Any], Optional[Dict[str, Any]]]
    shared: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # flag: argparse keywords
    smoke: Dict[str, Any] = field(default_factory=dict)  # defaults under --smoke
    finish: Callable[[Rows, Any], Any] = lambda rows, args: rows
    notes: Callable[[Any, Rows], List[str]] = lambda args, rows: []
    skip: Callable[[Dict[str, Any], Any], Optional[str]] = lambda run, args: None
    in_process: Union[bool, Callable[[Any], bool]] = False
    key: Tuple[str, ...] = ("variant",)
    timed: Tuple[str, ...] = ()  # what --repeats reports as medians
    baseline: Optional[str] = None  # what the ratio columns divide by, said under the table


def parse(benchmark: Benchmark, doc: Optional[str], argv: Optional[List[str]] = None) -> Any:
    """The benchmark's command line (kept as ``args.argv``): ``--out`` (default ``benchmarks/results/<name>.json``,
    the headline), ``--smoke``, ``--append``, the hidden ``--worker`` and ``--worker-out`` of a fresh process's run,
    the ``SHARED_FLAGS`` the benchmark names (``shared=dict(steps=200)``: ``--steps``, default 200), its own flags."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{benchmark.name}.json")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (the description says more)")
    parser.add_argument("--append", action="store_true", help="keep --out's rows of runs not run now")
    parser.add_argument("--worker", type=json.loads, help=argparse.SUPPRESS)  # the run a worker measures
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)  # where it writes the row
    for key, default in benchmark.shared.items():
        kind, help_text = SHARED_FLAGS[key]
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=default, help=help_text)
    for flag, options in benchmark.options.items():
        parser.add_argument(flag, **options)
    parser.set_defaults(argv=argv, **(benchmark.smoke if "--smoke" in argv else {}))
    return parser.parse_args(argv)


def main(benchmark: Benchmark, doc: Optional[str], argv: Optional[List[str]] = None) -> Optional[Rows]:
    """Run the benchmark as its command line says; a worker process measures its one run."""
    args = parse(benchmark, doc, argv)
    timeout = getattr(args, "timeout", None) or getattr(args, "variant_timeout", None)
    if args.worker is not None:
        run_args(args, args.worker)
        return worker(args.worker_out, lambda: benchmark.measure(args), timeout)
    in_process = benchmark.in_process(args) if callable(benchmark.in_process) else benchmark.in_process
    meta = environment() | {"isolation": "one process, compiler state reset per run" if in_process else "fresh process"}
    rows, notes, named = [], [], lambda row: tuple(row.get(key) for key in benchmark.key)
    args.started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{benchmark.name}-", ignore_cleanup_errors=True) as scratch:
        args.scratch = Path(scratch)
        runs = benchmark.runs(args)
        if args.append and args.out.exists():
            old, again = json.loads(args.out.read_text()), {named(run) for run in runs}
            rows, notes = [row for row in old["rows"] if named(row) not in again], old["notes"]
            meta["command"] = f"{old['meta'].get('command')} && {meta['command']}"
        for run in runs:
            row = {key: value for key, value in run.items() if not key.startswith("_")}
            rows.append(row | measure_run(benchmark, run, args, in_process, timeout or 600))
            print(f"{' '.join(map(str, named(row)))}: {json.dumps(rows[-1])[:300]}", flush=True)
            rows[:] = benchmark.finish(rows, args)  # the file written after each run: a run cut short keeps its rows
            notes += [note for note in benchmark.notes(args, rows) if note not in notes]
            write_result(args.out, benchmark.name, benchmark.title, benchmark.columns, rows, notes, meta)
    print_table(benchmark.columns, rows, benchmark.baseline)
    print("\n".join(notes))
    return rows


def run_args(args: Any, run: Dict[str, Any]) -> Any:
    """``args`` with the run's fields set (``_name`` as ``name``, after the public ones)."""
    for key, value in sorted(run.items(), key=lambda item: item[0].startswith("_")):
        setattr(args, key.lstrip("_"), value)
    return args


def measure_run(benchmark: Benchmark, run: Dict[str, Any], args: Any, in_process: bool, timeout: float) -> Dict:
    """One run's row: why it cannot run, or its measure in this process, or in ``--repeats`` fresh ones."""
    why_not = benchmark.skip(run, args)
    if why_not:
        return {"error": why_not}
    if in_process:
        try:
            with fresh_compiler_state():
                return benchmark.measure(run_args(argparse.Namespace(**vars(args)), run)) or {}
        except Exception as error:  # one run's failure is its row, not the end of the benchmark
            return {"error": f"{type(error).__name__}: {error}".strip()[:400]}
    command = [*args.argv, "--worker", json.dumps(run, default=str)]
    log, repeats = args.out.with_name(f"{args.out.stem}.errors.log"), range(getattr(args, "repeats", None) or 1)
    results = [run_fresh(sys.argv[0], command, timeout, caches=run.get("_caches"), log=log) for _ in repeats]
    return repeated(results, benchmark.timed)


def device_for(smoke: bool) -> torch.device:
    """The GPU where there is one, except in a smoke run."""
    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


def rel_diff(values: Sequence[float], reference: Sequence[float]) -> Optional[float]:
    """The largest relative difference of ``values`` from ``reference`` (losses against eager's), pairwise."""
    pairs = list(zip(values, reference))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else None


def is_recompile(metric: Any) -> bool:
    """A Dynamo compilation-metrics entry whose compile id "frame/attempt" has attempt > 0: a recompile."""
    return split_compile_id(str(metric.compile_id))[1] > 0


def frame_compile_seconds(metric: Any) -> float:
    """A frame's compile time from a compilation-metrics entry (the field differs across torch versions)."""
    seconds = getattr(metric, "entire_frame_compile_time_s", None)
    return seconds if seconds is not None else (getattr(metric, "duration_us", None) or 0) / 1e6


def variant_policy(variant: str, **settings: Any) -> Any:
    """The policy a variant names, ``name@key=value@...``: the bundled ``name`` (with ``settings``), every rule's
    ``key`` set to ``value`` (``regional@rest=outer``: an experiment on a bundled policy)."""
    from compile_trainer.schema import to_policy

    name, *pairs = variant.split("@")
    policy, changes = to_policy(name, **settings), dict(pair.split("=", 1) for pair in pairs)
    return to_policy(policy, rules=[dict(vars(rule), **changes) for rule in policy.rules]) if changes else policy


def git_commit() -> Optional[str]:
    """The checkout's short commit, ``-dirty`` when tracked files changed; None without git or a checkout."""
    command = ["git", "describe", "--always", "--dirty", "--exclude=*"]  # no tags: the commit itself
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> Dict[str, Any]:
    """What measured a result: date, command, commit, device and versions (the libraries' from their metadata)."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor()})"
    meta = dict(date=datetime.date.today().isoformat(), command=" ".join(["python", *sys.argv]), commit=git_commit())
    meta |= dict(python=platform.python_version(), torch=torch.__version__, device=device)
    installed = {dist.metadata["Name"].lower(): dist.version for dist in importlib.metadata.distributions()}
    return meta | {name: installed.get(name) for name in ("triton", "lightning", "transformers", "timm", "accelerate")}


def flop_rates(flops: Optional[float], step_s: float, device: torch.device) -> Dict[str, Optional[float]]:
    """TFLOP/s of a step of ``flops`` in ``step_s``, and its MFU against the GPU's dense bf16 peak from the
    library's table (H100, H200, A100; None elsewhere)."""
    peak = table_peak_flops(torch.cuda.get_device_name(device), torch.bfloat16) if device.type == "cuda" else None
    rate = flops / step_s if flops else None
    return {"tflops": rate / 1e12 if rate else None, "mfu": rate / peak if rate and peak else None}


def timed_row(times: Dict[str, float], device: torch.device, flops: Optional[float]) -> Dict[str, Any]:
    """A timed run's figures from ``first_warm_timed``'s ``times``: its first step, median and slowest step, their
    TFLOP/s and MFU, the peak memory and the graphs Dynamo compiled."""
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "first_step_s": times["first_step_s"],
        "step_ms": times["step_s"] * 1e3,
        "slowest_step_ms": times["slowest_step_s"] * 1e3,
        **flop_rates(flops, times["step_s"], device),
        "peak_mem_gib": memory,
        "graphs": compat.unique_graphs(),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Per-step times from CUDA events (read once, at the end), or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pairs: List[Tuple[Any, Any]] = []

    def start(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Any) -> None:
        self.pairs.append((started, self.start()))

    def seconds(self) -> List[float]:
        synchronize(self.device)
        if self.device.type == "cuda":
            return [start.elapsed_time(end) / 1e3 for start, end in self.pairs]
        return [end - start for start, end in self.pairs]


def first_warm_timed(
    device: torch.device, step: Callable, warmup: int, steps: int, eager: Callable = lambda: False, max_eager: int = 0
) -> Dict[str, float]:
    """``step(index)`` for a run: the first step timed alone (``first_step_s``: its compile), steps while ``eager()``
    (a background compile not in use yet; ``max_eager`` in all), ``warmup - 1`` more, then ``steps`` each timed
    (``step_s``: their median; ``slowest_step_s``) and the window's wall time between two device syncs. A full
    garbage collection runs before the window: a compile leaves millions of objects, and the collection they
    trigger some steps later (0.6-0.8 s after T5-base's background compile on an H100) is a one-time pause, not
    the steady state the window measures."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_step, start, timer = timed(device, lambda: step(0)), 1, StepTimer(device)
    while eager() and start < max_eager:
        step(start)
        start += 1
    for index in range(start, start + warmup - 1):
        step(index)
    start += max(warmup - 1, 0)
    gc.collect()

    def window() -> None:
        for index in range(start, start + steps):
            started = timer.start()
            step(index)
            timer.stop(started)

    window_s, seconds = timed(device, window), timer.seconds()
    median, slowest = statistics.median(seconds), max(seconds)
    return {"first_step_s": first_step, "step_s": median, "slowest_step_s": slowest, "window_s": window_s}


def training_step(
    optimizer: Any, loss_of: Callable, device: torch.device, applied: Any = None, scheduler: Any = None, mark_step=False
) -> Callable[[Any], torch.Tensor]:
    """A training step on a batch as every benchmark runs it: the applied policy's ``begin_step`` (with CUDA
    graphs, a step's regions share one CUDA-graph step), the loss under bf16 autocast on a GPU, backward, the
    optimizer's (and scheduler's) step. Returns the loss detached (clone it to keep it past a CUDA-graph replay)."""

    def step(batch: Any) -> torch.Tensor:
        if applied is not None:
            applied.begin_step()
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def recompile_reasons(limit: Optional[int] = None) -> List[str]:
    """Why Dynamo recompiled, one line per recompile of this process."""
    from torch._dynamo.utils import get_compilation_metrics

    recompiles = [metric for metric in get_compilation_metrics() if is_recompile(metric)]
    return [f"{m.compile_id} {m.co_name}: {getattr(m, 'recompile_reason', None)}" for m in recompiles][:limit]


def quiet_trainer(device: torch.device, **trainer_args: Any) -> Any:
    """A Lightning Trainer on one ``device`` without logger, checkpoints, progress bar, summary or validation."""
    import lightning.pytorch as pl

    defaults = dict(accelerator=device.type, devices=1, logger=False, enable_checkpointing=False)
    defaults |= dict(enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    return pl.Trainer(**(defaults | trainer_args))


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of ``fn`` with the device synchronized on both sides."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def write_result(
    path: Path, benchmark: str, title: str, columns: List[str], rows: Rows, notes: List[str], meta: Any = None
) -> None:
    """The result file ``make_report.py`` renders; ``meta`` (a dict) defaults to this process's ``environment()``."""
    result = dict(benchmark=benchmark, title=title, meta=meta or environment(), columns=columns, rows=rows, notes=notes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def print_table(columns: List[str], rows: Rows, baseline: Optional[str] = None) -> None:
    """The rows side by side, each cell as docs/BENCHMARKS.md shows it; ``baseline`` names the variant the ratio
    columns divide by."""
    print("\n".join(text_table(columns, [[cell(row.get(c)) for c in columns] for row in rows])))
    if baseline:
        print(f"ratios (*_vs_*) against {baseline}; with repeats, of medians")


def add_ratio(
    rows: Rows, name: str, column: str, is_baseline: Callable, group: Callable = lambda row: None, inverse: bool = False
) -> Rows:
    """Set ``row[name]`` to ``row[column]`` over the baseline row's of the same ``group`` (the baseline's over the
    row's with ``inverse``: a speed-up from times) on every row where both are measured; returns ``rows``."""
    baselines = {group(row): row[column] for row in rows if is_baseline(row) and row.get(column)}
    for row in rows:
        base = baselines.get(group(row))
        if base and row.get(column) and not row.get("error"):
            row[name] = base / row[column] if inverse else row[column] / base
    return rows


def repeated(results: Rows, metrics: Sequence[str]) -> Dict[str, Any]:
    """One row from several runs of a variant: the first run's fields, each of ``metrics`` the median over the runs
    that measured it, ``spread`` its [min, max], ``repeats`` how many counted (an error if none did)."""
    done = [result for result in results if not result.get("error")]
    if len(results) == 1 or not done:
        return results[0]
    row = dict(done[0], repeats=len(done), spread={})
    for metric in metrics:
        values = [result[metric] for result in done if isinstance(result.get(metric), (int, float))]
        if values:
            row[metric] = statistics.median(values)
            row["spread"][metric] = [min(values), max(values)]
    return row


def fresh_compiler_state() -> Any:
    """Forget what this process compiled (Dynamo's caches, counters, metrics) and return a context with empty
    Inductor/Triton caches."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return compat.fresh_inductor_cache()


def run_fresh(
    script: str, args: List[str], timeout: float, caches: Optional[Path] = None, log: Optional[Path] = None
) -> Dict[str, Any]:
    """``python script args... --worker-out FILE`` in a fresh process with empty Inductor and Triton caches of its
    own (in ``caches`` when given, which outlive the run). Returns the JSON the worker wrote; on a failure or a
    timeout, with the ``error`` (a worker that wrote its row and then failed, in teardown say, keeps the row), the
    output appended to ``log``."""

    def text(output: Any) -> str:  # a timeout's output comes as bytes, or None
        return output.decode(errors="replace") if isinstance(output, bytes) else output or ""

    def tail(output: str) -> str:
        return " | ".join(output.strip().splitlines()[-3:])[-300:]

    with tempfile.TemporaryDirectory(prefix="benchmark-") as scratch:
        folder, out = caches or Path(scratch), Path(scratch) / "result.json"
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "TRITON_CACHE_DIR": str(folder / "triton")}
        command = [sys.executable, str(script), *args, "--worker-out", str(out)]
        error = None
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            output = done.stdout + done.stderr
            if done.returncode != 0 or not out.exists():
                error = f"exit code {done.returncode} | " + tail(done.stderr or done.stdout)
        except subprocess.TimeoutExpired as expired:
            output = text(expired.stdout) + text(expired.stderr)
            error = f"timed out after {timeout:.0f} s | " + tail(text(expired.stderr))
        try:  # a worker that failed while writing leaves a partial file: its error stands, the row is lost
            written = json.loads(out.read_text()) if out.exists() else {}
        except json.JSONDecodeError as partial:
            written, error = {}, error or f"unreadable result ({partial})"
    if error is None:
        return written
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as file:
            file.write(f"==== {' '.join(args)} ({time.strftime('%H:%M:%S')})\n{output.rstrip()}\n\n")
    return written | {"error": error}


def worker(out: Path, measure: Callable[[], Any], timeout: Optional[float] = None) -> None:
    """The fresh process's side of ``run_fresh``: ``measure()``'s result as JSON in ``out``. A crash, or a hang
    past ``timeout`` seconds (less 10), prints every thread's Python stack."""
    faulthandler.enable(all_threads=True)
    if timeout:
        faulthandler.dump_traceback_later(max(timeout - 10, 5), exit=True)
    result = measure()
    if result is not None:
        Path(out).write_text(json.dumps(result))
