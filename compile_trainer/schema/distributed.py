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
    """

    consistent_dynamic_shapes: bool = False
    report_divergent_recompiles: bool = True
