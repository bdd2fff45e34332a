"""Telemetry on vs off: steady step time of GPT-2 small under the ``regional`` policy, in one process. Compiled once;
then windows of steps alternate ``FitTelemetry``'s per-step hooks (what ``CompileCallback`` calls) off and on, in
ABBA order so drift cancels. Also: the hooks' host time, and the telemetry's own step time beside the wall clock's.

    python benchmarks/telemetry_overhead.py                        # GPU
    python benchmarks/telemetry_overhead.py --peak-tflops 989      # H200: give the peak for MFU
    python benchmarks/telemetry_overhead.py --smoke --out /tmp/telemetry_overhead.json   # CPU, tiny model, seconds
"""

import statistics
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, models  # noqa: E402
from compile_trainer.compiling.regions import apply_policy  # noqa: E402
from compile_trainer.lightning.fit_telemetry import FitTelemetry  # noqa: E402
from compile_trainer.schema import CompilePolicy, Rule, TelemetryConfig, validate_policy  # noqa: E402
from compile_trainer_recipes.gpt import LanguageModel  # noqa: E402

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
WARMUP = 3  # steps with telemetry before the windows: the first compiles


def measure(args: Any) -> Dict[str, Any]:
    device = common.device_for(args.smoke)
    shape = TINY if args.smoke else asdict(models.GPT2_SMALL)
    torch.manual_seed(0)
    module = LanguageModel(model=shape, fused=device.type == "cuda").to(device)
    tokens = torch.randint(0, shape["vocab_size"], (args.batch_size, shape["block_size"] + 1), device=device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    train = common.training_step(module.configure_optimizers()["optimizer"], lambda b: module.model(*b)[1], device)
    step = partial(train, batch)

    telemetry = FitTelemetry(TelemetryConfig(items_per_sample=shape["block_size"], peak_tflops=args.peak_tflops))
    telemetry.before_policy(module)
    rule = Rule(name="model", action="regional", rest="compile")
    # The bundled `regional`'s rule built here, in the default mode: reading a bundled policy needs omegaconf, which
    # the GPU image lacks, and a policy named after a bundled one is compared with it (compiling/arguments.py).
    policy = CompilePolicy(name="regional_blocks", backend=args.backend, rules=[rule])
    applied = apply_policy(module, validate_policy(policy), device=device)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=10, loggers=[], lightning_module=module,
                              precision="bf16-mixed" if device.type == "cuda" else "32-true")  # fmt: skip
    telemetry.start(trainer, module, applied)
    hook_seconds: List[float] = []

    def hook(call: Callable[[Any, Any], None]) -> None:
        started = time.perf_counter()
        call(trainer, batch)
        hook_seconds.append(time.perf_counter() - started)

    def step_with_telemetry() -> None:
        hook(telemetry.on_train_batch_start)
        step()
        hook(telemetry.on_train_batch_end)
        trainer.global_step += 1

    def window(run: Callable[[], Any]) -> float:
        """Seconds a step over ``args.steps_per_window`` steps of ``run``, between two device syncs."""
        return common.timed(device, lambda: [run() for _ in range(args.steps_per_window)]) / args.steps_per_window

    warmup_s = common.timed(device, lambda: [step_with_telemetry() for _ in range(WARMUP)])
    windows: Dict[str, List[float]] = {"off": [], "on": []}
    hook_seconds.clear()
    for arm in (["off", "on", "on", "off"] * args.windows)[: 2 * args.windows]:  # as many "on" as "off"
        windows[arm].append(window(step_with_telemetry if arm == "on" else step))
    off, on = statistics.median(windows["off"]), statistics.median(windows["on"])
    hook_s = sum(hook_seconds) / (args.windows * args.steps_per_window)
    summary = telemetry.summary()
    telemetry.stop()
    return {
        "step_time_off_s": off,
        "step_time_on_s": on,
        "overhead_percent": (on / off - 1.0) * 100.0,
        "hook_host_us_per_step": hook_s * 1e6,
        "hook_host_percent_of_step": hook_s / off * 100.0,
        "telemetry_steady_step_time_s": summary["steady_step_time_s"],
        "tokens_per_s": summary["steady_items_per_s"],
        "mfu": summary["mfu"],
        "warmup_s": warmup_s,
        "window_step_times_s": windows,
        "telemetry_summary": summary,
    }


BENCHMARK = common.Benchmark(
    name="telemetry_overhead",
    title="Telemetry on vs off: steady step time of GPT-2 small under the regional policy",
    columns="""model batch_size step_time_off_s step_time_on_s overhead_percent hook_host_us_per_step
    hook_host_percent_of_step telemetry_steady_step_time_s tokens_per_s mfu warmup_s error""".split(),
    runs=lambda args: [{"model": "tiny" if args.smoke else "gpt2_small", "batch_size": args.batch_size}],
    measure=measure,
    shared=dict(backend="inductor"),
    options={
        "--batch-size": dict(type=int, default=8),
        "--windows": dict(type=int, default=12, help="windows per arm (even numbers keep ABBA balanced)"),
        "--steps-per-window": dict(type=int, default=25),
        "--peak-tflops": dict(type=float, help="device peak for MFU (H200: 989)"),
    },
    smoke=dict(batch_size=4, windows=2, steps_per_window=3, backend="eager"),
    notes=lambda args, rows: [
        f"policy regional, backend {args.backend}; {WARMUP} steps with telemetry (the first compiles), then "
        f"{args.windows} windows of {args.steps_per_window} steps per arm, off and on alternating (ABBA); step "
        "times: the median window's mean; hooks' host time: the hooks' own, per step with telemetry on"
    ],
    in_process=True,
    key=("model",),
)

if __name__ == "__main__":
    common.main(BENCHMARK, __doc__)
