"""The ``telemetry`` section: what the compile and throughput telemetry measures, and its pure checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

MIN_EAGER_REFERENCE_STEPS = 2  # the first pays one-off costs (CUDA's initialisation, the allocator's growth)


@dataclass
class TelemetryConfig:
    """What the compile and throughput telemetry measures (``telemetry`` in the Hydra config)."""

    enabled: bool = True
    # Tokens per batch for tokens/s: "package.module:function" taking the batch and returning an int (in Python, the
    # function itself); default: the batch's token ids (input_ids, or the first of a tuple), real ones by its mask.
    tokens_fn: Optional[str] = None
    # Samples per batch, likewise; default: the leading dimension of the batch's first tensor.
    samples_fn: Optional[str] = None
    # Items for items/s, in a unit of your own: a fixed number per sample, or a function of the batch; default: tokens.
    items_per_sample: Optional[int] = None
    items_fn: Optional[str] = None
    # What those items are (tokens, frames, ...): the name the summary and the sweep report give them.
    items_unit: str = "items"
    # Count the model FLOPs of the first training step while it runs, for TFLOP/s and MFU.
    measure_flops: bool = True
    # FLOPs of one step, instead of measuring them.
    flops_per_step: Optional[float] = None
    # The device's peak TFLOP/s for MFU, where Lightning's table lacks the device (e.g. H200).
    peak_tflops: Optional[float] = None
    # How often series are logged; default: the Trainer's log_every_n_steps.
    log_every_n_steps: Optional[int] = None
    # Print the summary table at the end of fit.
    print_summary: bool = True
    # On several ranks: measure the link at fit start (a short collective probe) and say in the plan what a step's
    # communication costs on it under the strategy, and which strategy or setting would be faster.
    link_probe: bool = True
    # The first training steps run the compiled regions' original code, timed: the eager step time that the summary's
    # speedup_vs_eager compares compiled steps with (the median of those after the first). 0: none, no speedup.
    eager_reference_steps: int = 5


def telemetry_config_problems(config: TelemetryConfig) -> List[str]:
    """What is wrong with ``config``, as messages naming what is valid (empty when all is well)."""
    problems = []
    for name in ("items_per_sample", "flops_per_step", "peak_tflops", "log_every_n_steps"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            problems.append(f"telemetry.{name} must be positive, got {value!r}")
    if config.eager_reference_steps != 0 and not config.eager_reference_steps >= MIN_EAGER_REFERENCE_STEPS:
        problems.append(
            f"telemetry.eager_reference_steps must be 0 (no eager reference) or at least {MIN_EAGER_REFERENCE_STEPS} "
            f"(the first pays one-off costs and is left out of the median), got {config.eager_reference_steps!r}"
        )
    if not config.items_unit.isidentifier():
        problems.append(f"telemetry.items_unit must be a word such as tokens or frames, got {config.items_unit!r}")
    if config.items_fn is not None and config.items_per_sample is not None:
        problems.append(
            f"give telemetry.items_fn or telemetry.items_per_sample, not both (items_fn {config.items_fn!r}, "
            f"items_per_sample {config.items_per_sample!r}: a recipe sets items_per_sample from its tokens_per_sample; "
            "with items_fn on the command line, add telemetry.items_per_sample=null)"
        )
    return problems
