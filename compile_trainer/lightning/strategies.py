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
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from compile_trainer.schema import PolicyError

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
    """``single``, ``ddp`` or ``fsdp2``; a ``PolicyError`` naming the strategies that work for any other."""
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    if isinstance(strategy, SingleDeviceStrategy):
        return "single"
    name = type(strategy).__name__
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
