"""The ``distributed`` section of a policy: what the policy does when the model trains on several ranks.

Imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistributedSettings:
    """Settings that matter only under a distributed strategy (DDP, FSDP2); ignored on one process.

    ``consistent_dynamic_shapes``: turn on PyTorch's compiler collectives
    (``torch._dynamo.config.enable_compiler_collectives``): at each compile the ranks exchange what Dynamo
    learned about their input sizes, so that every rank makes the same static/dynamic decision and compiles
    the same graphs. Without it, a rank that sees a new size alone may recompile alone (or make a size dynamic
    alone), its collectives out of step with the others': a hang or a slow rank. Every rank must then compile at
    the same points (a collective runs inside each compile).
    ``report_divergent_recompiles``: at fit end, gather each rank's compile time and recompiles to rank 0 and
    name the ranks whose recompiles differ from the others'.
    ``split_graphs_at_ddp_buckets``: leave on Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``),
    which splits every graph compiled inside DDP's forward at the gradient-bucket boundaries, so that bucket
    all-reduces can start inside a compiled backward. Off by default (the policy turns DDPOptimizer off for the
    fit): regions already give DDP a backward per block, and the splits cost more than the overlap they buy
    (GPT-2 small on 2 x H200, torch 2.11: DDP scaling 1.67x -> 1.75x under ``regional``, 1.17x -> 1.64x under
    ``full`` with the split off; ``benchmarks/distributed.py --experiments ddp-options``).
    """

    consistent_dynamic_shapes: bool = False
    report_divergent_recompiles: bool = True
    split_graphs_at_ddp_buckets: bool = False
