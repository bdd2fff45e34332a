"""``torch.compile``'s arguments for each region's settings on a device, and what they ask of Inductor."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from compile_trainer import compat
from compile_trainer.planning.plan import Region
from compile_trainer.schema import CompilePolicy, CompileSettings, bundled_policy_names, to_policy

log = logging.getLogger(__name__)

CPU_FALLBACK_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The bundled policies chosen for their mode: where it does not apply, the plan says so. The other bundled policies'
# mode (regional's reduce-overhead) is what they do where it applies (CUDA graphs on a GPU), dropped elsewhere
# without a note unless the user chose it.
POLICIES_FOR_THEIR_MODE = ("reduce_overhead", "max_autotune")


def compile_kwargs(settings: CompileSettings, device: torch.device) -> Tuple[Dict[str, Any], List[str]]:
    """``torch.compile`` keyword arguments for ``settings`` on ``device``, with notes on what changed.

    ``mode`` and ``options`` only mean something to Inductor; both may be given (the mode's options
    are merged under the explicit ones). CUDA-graph and autotuning modes fall back to the default
    mode on the CPU, where they either do nothing or take many minutes.
    """
    notes: List[str] = []
    mode, options = settings.mode, dict(settings.options)
    if settings.backend != "inductor" and (mode or options):
        notes.append(f"mode/options ignored: backend {settings.backend!r} does not take them")
        mode, options = None, {}
    if device.type == "cpu" and mode in CPU_FALLBACK_MODES:
        notes.append(f"mode {mode!r} needs a GPU; using the default mode on the CPU")
        mode = None
    if mode == "default":
        mode = None
    if mode and options:
        options = {**compat.inductor_mode_options(mode), **options}
        mode = None
    kwargs = {
        "backend": settings.backend,
        "mode": mode,
        "fullgraph": settings.fullgraph,
        "dynamic": settings.dynamic,
        "options": options or None,
    }
    return kwargs, notes


def regions_compile_kwargs(
    regions: Sequence[Region], policy: CompilePolicy, device: torch.device
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Each region's ``torch.compile`` arguments on ``device`` (``compile_kwargs``; its settings first made for
    sizes that vary, where they do), and the notes on what changed, each naming the regions it concerns; one on a
    mode the user did not choose (``bundled_default_settings``) goes to the debug log instead."""
    every_kwargs, noted, unnoted = [], {}, {}  # note -> the regions it applies to
    sizes_vary = bool(policy.shapes.dynamic) or policy.distributed.consistent_dynamic_shapes
    unchosen = bundled_default_settings(policy)
    for region in regions:
        asked = (region.settings.mode, dict(region.settings.options))
        region.settings = settings_for_varying_sizes(region.settings, sizes_vary)
        kwargs, notes = compile_kwargs(region.settings, device)
        for note in notes:  # one about a mode the user did not choose goes to the debug log alone
            (unnoted if asked == unchosen else noted).setdefault(note, []).append(region.name)
        every_kwargs.append(kwargs)
    for note in _per_regions(unnoted, len(regions)):
        log.debug("%s (%s's default mode)", note, policy.name)
    return every_kwargs, _per_regions(noted, len(regions))


def _per_regions(noted: Dict[str, List[str]], every: int) -> List[str]:
    """Each note once, with the regions it concerns (``all regions`` where it concerns ``every`` one)."""
    return [f"{'all regions' if len(names) == every else ', '.join(names)}: {note}" for note, names in noted.items()]


def bundled_default_settings(policy: CompilePolicy) -> Optional[Tuple[Optional[str], Dict[str, Any]]]:
    """(mode, options) of the bundled policy ``policy`` is named after, where they are a default for the GPU rather
    than what the policy is for (``POLICIES_FOR_THEIR_MODE``): a region with these the user did not choose."""
    if policy.name in POLICIES_FOR_THEIR_MODE or policy.name not in bundled_policy_names():
        return None
    bundled = to_policy(policy.name)
    return bundled.mode, dict(bundled.options)


def settings_for_varying_sizes(settings: CompileSettings, sizes_vary: bool) -> CompileSettings:
    """Where sizes vary between calls, Inductor options that keep Inductor from guarding on them
    (``compat.inductor_options_without_size_guards``); options the policy gives win. Sizes vary when they are
    declared dynamic (``shapes.dynamic``), and under compiler collectives (``distributed.consistent_dynamic_shapes``)
    whatever made them dynamic: there a guard on a size, checked against each rank's own sizes, recompiles one
    rank alone, which then waits in the compile's collective for ranks that never join it."""
    if not sizes_vary or settings.backend != "inductor":
        return settings
    options = {**compat.inductor_options_without_size_guards(), **settings.options}
    return dataclasses.replace(settings, options=options)


def kwargs_use_cuda_graphs(kwargs: Dict[str, Any]) -> bool:
    """Whether ``torch.compile(**kwargs)`` (``compile_kwargs``) asks Inductor for CUDA graphs, by its mode's
    options (``reduce-overhead``, ``max-autotune``) or its own."""
    mode_options = compat.inductor_mode_options(kwargs["mode"]) if kwargs["mode"] else {}
    return bool({**mode_options, **(kwargs["options"] or {})}.get("triton.cudagraphs"))
