"""Which of Lightning's strategies a compile policy works under, and where the compile goes under each.

- one process (``SingleDeviceStrategy``): the callback applies the policy at ``on_fit_start``.
- ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ``ddp_fork``): Lightning wraps the module in
  ``DistributedDataParallel`` in ``strategy.setup``, before ``on_fit_start``; the regions are the module's own
  submodules, compiled in place inside the wrapper, never around it. They run inside DDP's forward, where
  Dynamo's DDPOptimizer would split each of their graphs at the bucket boundaries; the policy turns it off
  (``distributed.split_graphs_at_ddp_buckets``), so the graphs and recompiles are those of one process,
  whatever ``bucket_cap_mb``.
- ``ModelParallelStrategy`` (FSDP2): the blocks must be compiled before ``fully_shard`` wraps them (torchtitan's
  order: activation checkpointing, compile each block, ``fully_shard`` each block, then the root), which
  happens in the user's ``configure_model``, a hook a callback cannot reach into: call
  ``compile_trainer.apply_policy(self, policy)`` there before sharding; the callback adopts that policy. A
  background policy compiles in the foreground there (``BACKGROUND_IN_FOREGROUND_UNDER_FSDP2``), and bucket
  warm-up is off (``BUCKET_WARMUP_OFF_UNDER_FSDP2``).
- anything else (``FSDPStrategy``, DeepSpeed, XLA...) is refused before training, naming those that work.

On several ranks, ``link_plan`` measures the link at fit start and models what a step sends over it
(``telemetry.link``, ``telemetry.communication``); ``refuse_before_launch`` refuses, before any process starts, a
strategy or a policy setting that would be refused in each of them.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
    XLAStrategy,
)
from lightning.pytorch.utilities import rank_zero_warn

from compile_trainer.compiling.regions import APPLIED_ATTR, AppliedPolicy
from compile_trainer.schema import CompilePolicy, PolicyError, policy_to_dict
from compile_trainer.telemetry.communication import (
    DDP_BUCKET_BYTES,
    FSDP2_SETTINGS_ATTR,
    Fsdp2Settings,
    LinkPlan,
    ModelShape,
    ddp_step,
    fsdp2_step,
    fsdp2_units,
    probe_requests,
    step_communication,
)
from compile_trainer.telemetry.link import dtype_name, gpu_topology, probe_link

log = logging.getLogger(__name__)

SUPPORTED = (
    "one device (strategy='auto'), strategy='ddp' (also 'ddp_spawn', 'ddp_fork'), or FSDP2 through "
    "ModelParallelStrategy with compile_trainer.apply_policy called in configure_model before fully_shard"
)
FSDP2_RECIPE = (
    "under ModelParallelStrategy (FSDP2) compile the blocks before they are sharded: in configure_model, call "
    "compile_trainer.apply_policy(self, policy) first, then fully_shard each block and the root "
    "(docs/distributed.md)"
)


def strategy_kind(strategy: Any) -> str:
    """``single``, ``ddp`` or ``fsdp2`` for a strategy (or its class); a ``PolicyError`` naming the strategies that
    work for any other."""
    kind = strategy if isinstance(strategy, type) else type(strategy)
    if issubclass(kind, ModelParallelStrategy):
        return "fsdp2"
    if issubclass(kind, DDPStrategy) and not issubclass(kind, (DeepSpeedStrategy, XLAStrategy)):  # their subclasses
        return "ddp"
    if issubclass(kind, SingleDeviceStrategy):
        return "single"
    name = kind.__name__
    why = ""
    if name == "FSDPStrategy":
        why = (
            " (FSDP1: it wraps the blocks in strategy.setup, before on_fit_start, so the regions would be compiled "
            "inside FSDP1 units over FlatParameters, which this library neither supports nor tests; FSDP2 takes "
            "the compiled blocks instead)"
        )
    raise PolicyError(f"CompileCallback does not support {name}{why}; supported: {SUPPORTED}")


BACKGROUND_IN_FOREGROUND_UNDER_FSDP2 = (
    "under FSDP2 each region compiles at its first call on the training thread, as with background: false: the "
    "compile thread calls a copy of each region, and an FSDP2 block can neither be copied (fully_shard's class "
    "re-runs __init__ in __new__; seen, torch 2.13) nor run its forward hooks off the training thread (the "
    "all-gather and reshard of its parameters, collectives every rank runs in step)"
)


BUCKET_WARMUP_OFF_UNDER_FSDP2 = (
    "shapes.warmup: off under FSDP2, each bucket compiles at its first batch: warm-up traces a copy of each region "
    "that compiled, and an FSDP2 block can neither be copied nor traced with its parameters as its calls see them "
    "(sharded outside its forward, gathered inside)"
)


def adopted_policy(
    module: Any, policy: CompilePolicy, kind: str, applied_before_fit: Optional[AppliedPolicy]
) -> Optional[AppliedPolicy]:
    """The policy on ``module`` a callback holding ``policy`` takes over: applied in ``configure_model`` (FSDP2:
    blocks compiled before ``fully_shard``) or left by an earlier fit with this policy; None where none is applied.
    Under FSDP2 a policy that compiles modules must have been applied in ``configure_model``; a different policy on
    the module is refused, naming how to undo it (``applied_before_fit``: what was on it before this fit began)."""
    applied = getattr(module, APPLIED_ATTR, None)
    if applied is None:
        if kind == "fsdp2" and policy.compiles_modules:
            raise PolicyError(f"policy {policy.name!r} was not applied before sharding: {FSDP2_RECIPE}")
        return None
    if policy_to_dict(applied.policy) == policy_to_dict(policy):
        return applied
    if applied is applied_before_fit:
        earlier = applied.applied_by == "CompileCallback"
        undo = "`earlier_callback.applied.remove()`" if earlier else "`.remove()` on what apply_policy returned"
        raise PolicyError(
            f"the model still carries compile policy {applied.policy.name!r}, applied before this fit began by "
            f"{'the CompileCallback of an earlier fit' if earlier else 'apply_policy'}, but this CompileCallback "
            f"holds {policy.name!r}; a model takes one policy at a time: undo the earlier one first with "
            f"{undo}, or fit with the callback that applied it"
        )
    raise PolicyError(
        f"configure_model applied policy {applied.policy.name!r}, but the CompileCallback holds "
        f"{policy.name!r}: apply the callback's own policy (callback.policy) there"
    )


def warms_up_buckets(kind: str) -> bool:
    """Whether ``shapes.warmup`` compiles the buckets ahead under strategy ``kind``: not under FSDP2
    (``BUCKET_WARMUP_OFF_UNDER_FSDP2``)."""
    return kind != "fsdp2"


def compiles_in_background(kind: str) -> bool:
    """Whether a background policy compiles on a thread under strategy ``kind`` (``strategy_kind``): under one
    process and DDP, yes; under FSDP2 in the foreground (``BACKGROUND_IN_FOREGROUND_UNDER_FSDP2``)."""
    return kind != "fsdp2"


def where_compiled(kind: str) -> str:
    """The plan table's line saying where the regions sit relative to the strategy's wrapper."""
    return {
        "single": "",
        "ddp": "strategy ddp: regions compiled in place inside DistributedDataParallel (the wrapper itself is not "
        "compiled); graphs split at DDP's bucket boundaries (Dynamo's DDPOptimizer) only with "
        "distributed.split_graphs_at_ddp_buckets",
        "fsdp2": "strategy fsdp2: regions compiled in configure_model before fully_shard (each compiled block "
        "sharded as its own FSDP unit); FSDP2's all-gather/reshard hooks run eagerly (Dynamo's skip_fsdp_hooks): "
        "a graph break where a block's frame calls them, expected",
    }[kind]


OPTIMIZER_UNDER_FSDP2 = (
    "compile.optimizer.compile={value} cannot run under FSDP2 (ModelParallelStrategy, trainer=gpu_fsdp2): the "
    "compiled optimizer step keeps the parameters as views of one flat buffer, which FSDP2's DTensor shards cannot "
    "become; set compile.optimizer.compile=false (the optimizer's own step), or train under DDP (trainer=gpu_ddp)"
)


def refuse_before_launch(strategy: Any, policy: CompilePolicy) -> None:
    """A ``PolicyError`` for a Trainer ``strategy`` (a registered name such as ``"ddp"``, or an instance) that the
    callback would refuse at ``setup``, or a policy setting it cannot run, before Lightning starts the ranks;
    ``"auto"`` and names Lightning does not know are left to Lightning."""
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry.available_strategies():
            return
        strategy = StrategyRegistry[strategy]["strategy"]  # the class: made, some need arguments or packages
    kind = strategy_kind(strategy)
    if kind == "fsdp2" and policy.optimizer.compile != "false":
        raise PolicyError(OPTIMIZER_UNDER_FSDP2.format(value=policy.optimizer.compile))


SKIPPED = "link probe skipped ({why}); telemetry.link_probe=false turns it off"
PROBE_MAX_BYTES = {"cuda": 256 * 2**20, "cpu": 4 * 2**20}  # larger messages take the rate of the largest probed


def model_shape(trainer: Any, pl_module: Any, kind: str) -> ModelShape:
    """What decides the step's communication (``ModelShape``): the module's parameters, DDP's bucket size, FSDP2's
    units and the settings ``compile_and_shard`` recorded (else FSDP2's defaults, marked assumed)."""
    params = list(pl_module.parameters())
    dtype = dtype_name(params[0].dtype) if params else "float32"
    bucket = getattr(trainer.strategy.model, "bucket_bytes_cap", DDP_BUCKET_BYTES)  # DistributedDataParallel's
    settings = getattr(pl_module, FSDP2_SETTINGS_ATTR, None) or Fsdp2Settings(dtype, dtype, assumed=True)
    device = pl_module.device
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    units = fsdp2_units(pl_module) if kind == "fsdp2" else None
    return ModelShape([p.numel() for p in params], dtype, trainer.world_size, units, settings, bucket, memory)


def link_plan(trainer: Any, pl_module: Any, kind: str) -> Optional[LinkPlan]:
    """On several ranks: the link probed at the message sizes a step moves under ``kind`` and under the settings
    it is compared with (a collective of a few sizes: well under a second on a GPU), the GPU topology, and the
    step's communication (``LinkPlan``). None on one process; a failure is a warning, never the run's end, and a
    rank that cannot probe makes every rank skip it (they agree first, so none waits in a collective alone)."""
    if kind == "single" or trainer.world_size < 2:
        return None
    try:
        shape = model_shape(trainer, pl_module, kind)
        steps = [step_communication(kind, shape)]
        if kind == "fsdp2":
            steps += [ddp_step(shape), fsdp2_step(shape, replace(shape.fsdp2, param_dtype="bfloat16"))]
        device = pl_module.device
        requests = probe_requests(steps, PROBE_MAX_BYTES.get(device.type, PROBE_MAX_BYTES["cpu"]))
        problem = None
    except Exception as error:
        problem = error
        log.warning(f"rank {trainer.global_rank}: {SKIPPED.format(why=f'{type(error).__name__}: {error}')}")
    if not trainer.strategy.reduce_boolean_decision(problem is None, all=True):
        if problem is None:
            rank_zero_warn(SKIPPED.format(why="another rank could not prepare it: its log says why"))
        return None
    try:
        probe = probe_link(requests, device, warmup=1, iterations=3)
        topology = gpu_topology() if device.type == "cuda" and trainer.is_global_zero else None
        return LinkPlan(kind, shape, probe, topology["summary"] if topology else None)
    except Exception as error:  # what the plan says informs; it never stops a run
        rank_zero_warn(SKIPPED.format(why=f"{type(error).__name__}: {error}"))
        return None
