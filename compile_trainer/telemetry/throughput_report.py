"""The throughput section of the end-of-fit summary, and the warning when compiled steps are slower than eager ones.

Both read the summary dict (``FitTelemetry.summary()``; keys in docs/telemetry.md). A figure that is unknown, or a
unit the batch does not have (tokens of an image batch, MFU without a peak), is left out rather than printed as -.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from compile_trainer.compiling.regions import AppliedPolicy

# A speedup under this warns: the steady median and the eager one each move by a few percent from run to run.
SLOWER_THAN_EAGER = 0.95


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def format_throughput(summary: Dict[str, Any]) -> List[str]:
    """The ``throughput`` lines of the end-of-fit summary."""
    lines = ["throughput", _steps_line(summary), _rates_line(summary)]
    lines += [line for line in (_compute_line(summary), speedup_line(summary)) if line]
    return lines


def _steps_line(summary: Dict[str, Any]) -> str:
    parts = []
    if summary.get("eager_steps"):
        parts.append(f"{summary['eager_steps']} eager for reference ({summary['eager_steps_time_s']:,.2f} s)")
    recorded = summary["cudagraph_recording_steps"]
    parts.append(
        f"{summary['compile_steps']} with compiles"
        + (f" or CUDA-graph recordings ({recorded})" if recorded else "")
        + f", {summary['compile_steps_time_s']:,.2f} s in them"
    )
    if summary["warmup_steps"]:
        parts.append(f"{summary['warmup_steps']} warm-up (FLOPs counted, cache loaded or CUDA graphs warmed up)")
    first = summary.get("first_step_time_s")
    if first is not None:
        parts.append(f"first {'compiled ' if summary.get('eager_steps') else ''}step {first:,.2f} s")
    return f"  {plural(summary['steps'], 'step')} ({'; '.join(parts)})"


def _rates_line(summary: Dict[str, Any]) -> str:
    mean, median = summary.get("steady_step_time_s"), summary.get("steady_step_time_median_s")
    if mean is None:
        return "  no steady steps (every step compiled, warmed up or ran eagerly for reference)"
    images = summary.get("steady_images_per_s")
    rates = [
        f"{summary['steady_steps_per_s']:,.2f} steps/s",
        f"{images:,.1f} images/s" if images is not None else f"{summary['steady_samples_per_s']:,.1f} samples/s",
    ]
    tokens, padded = summary.get("steady_tokens_per_s"), summary.get("steady_padded_tokens_per_s")
    if tokens is not None:
        padding = padded is not None and round(padded) != round(tokens)  # else no padding to tell apart
        rates.append(f"{tokens:,.0f} tokens/s" + (f" ({padded:,.0f} with padding)" if padding else ""))
    shown = {"images" if images is not None else "samples"} | ({"tokens"} if tokens is not None else set())
    unit = summary.get("items_unit")
    if unit and unit not in shown:  # a unit of the user's own, not one counted above
        rates.append(f"{summary['steady_items_per_s']:,.0f} {unit}/s")
    return f"  steady step {_ms(mean)} (median {_ms(median)}), " + ", ".join(rates)


def _flop_rate(flops: float) -> str:
    """FLOP/s in the largest unit that keeps a digit before the point (a small model on the CPU: GFLOP/s)."""
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if flops >= scale:
            return f"{flops / scale:,.2f} {unit}"
    return f"{flops:,.0f} FLOP/s"


def _compute_line(summary: Dict[str, Any]) -> Optional[str]:
    tflops, mfu, memory = summary.get("steady_tflops"), summary.get("mfu"), summary.get("peak_memory_bytes")
    parts = []
    if tflops is not None:
        parts.append(f"{_flop_rate(tflops * 1e12)} achieved")
    if mfu is not None:
        parts.append(f"MFU {mfu * 100:,.1f} %")
    if memory is not None:
        eager = summary.get("eager_peak_memory_bytes")
        parts.append(
            f"peak memory {memory / 2**30:,.2f} GiB"
            + (f" ({eager / 2**30:,.2f} GiB in the eager reference steps)" if eager is not None else "")
        )
    return f"  {', '.join(parts)}" if parts else None


def speedup_line(summary: Dict[str, Any]) -> Optional[str]:
    """Compiled steps against the eager reference steps, or None without both."""
    speedup = summary.get("speedup_vs_eager")
    if speedup is None:
        return None
    return (
        f"  speedup vs eager {speedup:,.2f}x: median step {_ms(summary['steady_step_time_median_s'])} compiled, "
        f"{_ms(summary['eager_step_time_median_s'])} eager (the median of "
        f"{plural(summary['eager_steps_in_median'], 'eager step')} at the fit's start, after the first)"
    )


def slower_than_eager(summary: Dict[str, Any], device_type: str, applied: Optional[AppliedPolicy]) -> Optional[str]:
    """A warning with what to try when compiled steady steps are slower than the eager reference steps, else None."""
    speedup = summary.get("speedup_vs_eager")
    if speedup is None or speedup >= SLOWER_THAN_EAGER:
        return None
    tries = ["train without compiling (policy `none`)", "a larger batch"]
    if applied is not None and applied.uses_inductor and device_type == "cpu":
        tries.append("on the CPU, Inductor's code often loses to eager kernels on a small model")
    if applied is not None and device_type == "cuda" and not applied.uses_cuda_graphs:
        tries.append("`mode: reduce-overhead` (CUDA graphs), where short steps wait on the CPU")
    if applied is not None and any(rule.action == "full" for rule in applied.policy.rules):
        tries.append("the `regional` policy")
    return (
        f"compiled steps are slower than eager ones: median {_ms(summary['steady_step_time_median_s'])} against "
        f"{_ms(summary['eager_step_time_median_s'])} eager ({speedup:.2f}x, eager median of "
        f"{plural(summary['eager_steps_in_median'], 'step')} in this fit). Try: {'; '.join(tries)}"
    )
