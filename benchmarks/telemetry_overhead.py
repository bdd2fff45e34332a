"""Telemetry on vs off: steady step time of GPT-2 small under the `regional` policy, in one process.

    python benchmarks/telemetry_overhead.py --out telemetry_overhead.json            # GPU
    python benchmarks/telemetry_overhead.py --out telemetry_overhead.json --peak-tflops 989  # H200: give the peak
    python benchmarks/telemetry_overhead.py --smoke --out /tmp/smoke.json            # CPU, tiny model, seconds

Compiled once; then windows of steps alternate telemetry off and on (ABBA order, so drift cancels), each timed
between two device syncs. "On" runs ``FitTelemetry``'s per-step hooks (what ``CompileCallback`` calls), its periodic
metrics included. Also reported: the hooks' host time, and the telemetry's own steady step time beside the wall
clock's (a check of its lazily read CUDA events). Needs torch and lightning only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import synchronize  # noqa: E402
from benchmarks.models import GPT2_SMALL  # noqa: E402
from compile_trainer.compiling.regions import apply_policy  # noqa: E402
from compile_trainer.lightning.fit_telemetry import FitTelemetry  # noqa: E402
from compile_trainer.schema import CompilePolicy, Rule, TelemetryConfig, validate_policy  # noqa: E402
from recipes.gpt import LanguageModel  # noqa: E402

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def parse_args(argv: List[str]) -> argparse.Namespace:
    smoke = "tiny model on the CPU with the eager backend"
    parser = common.arguments(__doc__, "telemetry_overhead", smoke, backend="inductor")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--windows", type=int, default=12, help="windows per arm (even numbers keep ABBA balanced)")
    parser.add_argument("--steps-per-window", type=int, default=25)
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (H200: 989)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_size, args.windows, args.steps_per_window, args.backend = 4, 2, 3, "eager"
    return args


def run(args: argparse.Namespace) -> Dict[str, Any]:
    device = common.device_for(args.smoke)
    shape = TINY if args.smoke else asdict(GPT2_SMALL)
    torch.manual_seed(0)
    module = LanguageModel(model=shape, fused=device.type == "cuda").to(device)
    optimizer = module.configure_optimizers()["optimizer"]
    tokens = torch.randint(0, shape["vocab_size"], (args.batch_size, shape["block_size"] + 1), device=device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"

    telemetry = FitTelemetry(TelemetryConfig(items_per_sample=shape["block_size"], peak_tflops=args.peak_tflops))
    telemetry.before_policy(module)
    policy = CompilePolicy(name="regional", backend=args.backend, rules=[Rule(name="model", action="regional")])
    policy.rules[0].rest = "compile"
    applied = apply_policy(module, validate_policy(policy), device=device)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=10, loggers=[], precision=precision)
    telemetry.start(trainer, module, applied)

    train = common.training_step(optimizer, lambda batch: module.model(*batch)[1], device)
    step = partial(train, batch)

    hook_seconds = 0.0

    def step_with_telemetry() -> None:
        nonlocal hook_seconds
        started = time.perf_counter()
        telemetry.on_train_batch_start(trainer, batch)
        hook_seconds += time.perf_counter() - started
        step()
        started = time.perf_counter()
        telemetry.on_train_batch_end(trainer, batch)
        hook_seconds += time.perf_counter() - started
        trainer.global_step += 1

    warmup_started = time.perf_counter()
    for _ in range(3):  # compiles (first step), then steady
        step_with_telemetry()
    synchronize(device)
    warmup_s = time.perf_counter() - warmup_started

    windows: Dict[str, List[float]] = {"off": [], "on": []}
    hook_seconds, hooked_steps = 0.0, 0
    order = ["off", "on", "on", "off"] * ((args.windows + 1) // 2)
    for arm in order[: 2 * args.windows]:
        synchronize(device)
        started = time.perf_counter()
        for _ in range(args.steps_per_window):
            step_with_telemetry() if arm == "on" else step()
        synchronize(device)
        windows[arm].append((time.perf_counter() - started) / args.steps_per_window)
        hooked_steps += args.steps_per_window if arm == "on" else 0

    off, on = statistics.median(windows["off"]), statistics.median(windows["on"])
    summary = telemetry.summary()
    telemetry.stop()
    return {
        "benchmark": "telemetry_overhead",
        "title": "Telemetry on vs off: steady step time of GPT-2 small under the regional policy",
        "meta": common.environment(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny" if args.smoke else "gpt2_small",
        "batch_size": args.batch_size,
        "backend": args.backend,
        "windows_per_arm": args.windows,
        "steps_per_window": args.steps_per_window,
        "warmup_s": warmup_s,
        "step_time_off_s": off,
        "step_time_on_s": on,
        "overhead_percent": (on / off - 1.0) * 100.0,
        "hook_host_us_per_step": hook_seconds / max(1, hooked_steps) * 1e6,
        "hook_host_percent_of_step": hook_seconds / max(1, hooked_steps) / off * 100.0,
        "window_step_times_s": windows,
        "telemetry_steady_step_time_s": summary["steady_step_time_s"],
        "telemetry_summary": summary,
    }


def print_table(result: Dict[str, Any]) -> None:
    summary = result["telemetry_summary"]
    rows = {
        "device": result["device"],
        "model / backend": f"{result['model']} / {result['backend']}, batch {result['batch_size']}",
        "steady step, telemetry off": f"{result['step_time_off_s'] * 1e3:.3f} ms (median of windows)",
        "steady step, telemetry on": f"{result['step_time_on_s'] * 1e3:.3f} ms",
        "overhead": f"{result['overhead_percent']:+.2f} %",
        "hooks' host time": f"{result['hook_host_us_per_step']:.1f} us/step",
        "hooks' host time / step": f"{result['hook_host_percent_of_step']:.3f} %",
        "telemetry's own steady step": f"{(result['telemetry_steady_step_time_s'] or 0) * 1e3:.3f} ms",
        "tokens/s (telemetry)": f"{summary['steady_items_per_s'] or 0:,.0f}",
        "MFU (telemetry)": f"{summary['mfu'] or float('nan'):.3f}",
    }
    print(common.format_table(["field", "value"], [{"field": k, "value": v} for k, v in rows.items()]))


def main(argv: List[str]) -> None:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
