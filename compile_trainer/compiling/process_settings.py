"""The process-wide settings a policy changes while it is applied (Dynamo's recompile limit, the DDP optimizer,
compiler collectives, the logger methods Dynamo drops, cuDNN attention), each held on an ``ExitStack`` that
``AppliedPolicy.remove()`` closes; and the planning's trial trace, which drops those logger methods as well."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, List, Sequence

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling.block_values import trial_trace
from compile_trainer.schema import CompilePolicy

CUDNN_ATTENTION_OFF = (
    "shapes.dynamic without shapes.pad: cuDNN attention is off while the policy is applied "
    "(scaled_dot_product_attention uses flash or memory-efficient attention): cuDNN builds a plan for every new "
    "length, about 5.5 ms of host time per attention call (H100, torch 2.11), which made a 16-layer Llama's steps "
    "host-bound; with lengths padded to a few (shapes.pad) each plan is built once and cuDNN stays on"
)


COMPILER_COLLECTIVES_NOTE = (
    "compiler collectives on: every rank makes the same dynamic-shape decisions, Inductor guards on no size; seen "
    "to hang on 2 x H200 before that (torch 2.11, regional, ranks of different lengths), not re-measured since "
    "(docs/distributed.md)"
)


def once_logger_methods() -> set:
    """Hugging Face's ``logger.warning_once`` (added to ``logging.Logger`` by transformers): inside a
    compiled region each is a graph break (GPT-2's loss property calls one every step), so Dynamo is told to drop
    them while tracing. The message is still printed by any eager call."""
    # One method only: Dynamo sorts this set when it logs its config, and two lru_cache wrappers do not compare
    # (torch 2.11 logs "Unexpected exception logging compilation metrics" for every compile).
    return {logging.Logger.warning_once} if hasattr(logging.Logger, "warning_once") else set()


def drop_once_logger_methods() -> set:
    """Tell Dynamo to drop ``once_logger_methods`` while tracing; returns the set to restore."""
    return compat.set_ignored_logger_methods(compat.ignored_logger_methods() | once_logger_methods())


def trial_trace_dropping_once_warnings(block: nn.Module, floats: Sequence[str], indices: Sequence[str]) -> Any:
    """``trial_trace`` with ``once_logger_methods`` dropped as the compiled regions drop them: a block that calls
    one (HF's attention asked for weights it cannot give) is traced instead of failing the trial."""
    previous = drop_once_logger_methods()
    try:
        return trial_trace(block, floats, indices)
    finally:
        compat.set_ignored_logger_methods(previous)


def hold_process_settings(policy: CompilePolicy, device: torch.device, held: contextlib.ExitStack) -> List[str]:
    """Change the process-wide settings ``policy`` asks for on ``device``, each restored when ``held`` closes;
    returns the notes for the plan."""
    # Restored by remove(), not by garbage collection: a generator-based context manager would restore them
    # whenever a forgotten AppliedPolicy is collected, under the feet of the policy applied since.
    notes = []
    held.callback(compat.set_recompile_limit, compat.set_recompile_limit(policy.recompile_limit))
    if not policy.distributed.split_graphs_at_ddp_buckets:
        held.callback(compat.set_optimize_ddp, compat.turn_off_ddp_optimizer())
    if policy.distributed.consistent_dynamic_shapes:
        held.callback(compat.set_compiler_collectives, compat.set_compiler_collectives(True))
        notes.append(COMPILER_COLLECTIVES_NOTE)
    held.callback(compat.set_ignored_logger_methods, drop_once_logger_methods())
    unpadded_lengths = policy.shapes.dynamic and not policy.shapes.pad.enabled
    if unpadded_lengths and device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        held.callback(torch.backends.cuda.enable_cudnn_sdp, True)
        notes.append(CUDNN_ATTENTION_OFF)
    return notes
