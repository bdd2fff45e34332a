"""``rest: nested``: the checks a module compiled whole with its blocks as nested compile regions must pass, and
the mark on the block classes' ``forward``."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.planning.plan import Region
from compile_trainer.planning.structure import structure_key
from compile_trainer.schema import PolicyError

NESTED_BACKENDS = ("aot_eager", "inductor")
# From this torch on, a nested block called once may update buffers in training (2.9.1 refused it; 2.12 untried)
NESTED_SINGLE_CALL_MUTATION_VERSION = (2, 13)


def check_nested(region: Region, kwargs: Dict[str, Any], device: torch.device, root: nn.Module) -> None:
    """Refuse a nested region whose backend, device or blocks' running statistics the nested compile cannot serve."""
    where = f"{region.name!r} (rule {region.rule_index}, rest: nested)"
    if kwargs["backend"] not in NESTED_BACKENDS:
        raise PolicyError(f"{where} needs an AOT backend ({', '.join(NESTED_BACKENDS)}), not {kwargs['backend']!r}.")
    if kwargs["backend"] == "inductor" and device.type == "cpu":
        raise PolicyError(
            f"{where}: Inductor on the CPU computed wrong gradients for nested compile regions (seen on torch 2.13); "
            "use rest: compile, or backend aot_eager on the CPU."
        )
    groups: Dict[str, List[str]] = {}  # structure -> the nested blocks that call one subgraph
    for name in region.nested_blocks:
        groups.setdefault(structure_key(root.get_submodule(name)), []).append(name)
    single_call_problem = compat.needs_torch(
        "a nested block called once that updates buffers in place in training", NESTED_SINGLE_CALL_MUTATION_VERSION
    )
    for names in (names for names in groups.values() if len(names) > 1 or single_call_problem):
        block = root.get_submodule(names[0])
        stats = next((name for name, m in block.named_modules() if _updates_running_stats(m)), None)
        if stats is not None:
            refused = (
                f"torch's invoke_subgraph refuses in-place buffer updates in a subgraph it calls more than once "
                f"(torch {torch.__version__})"
                if len(names) > 1
                else single_call_problem
            )
            raise PolicyError(
                f"{where}: the nested block(s) {', '.join(map(repr, names))} hold "
                f"{'.'.join(filter(None, (names[0], stats)))!r} ({type(block.get_submodule(stats)).__name__}), whose "
                f"forward updates its running statistics in place in training: {refused}. Use rest: compile (the "
                "'regional' policy), or norms without running statistics (track_running_stats=False)."
            )


def _updates_running_stats(module: nn.Module) -> bool:
    """A norm in training that updates running statistics (BatchNorm, SyncBatchNorm, and norms like them)."""
    return module.training and getattr(module, "track_running_stats", False) and hasattr(module, "running_mean")


def mark_nested_blocks(marked: Dict[type, Optional[Callable[..., Any]]], root: nn.Module, region: Region) -> None:
    """Mark each block class's ``forward`` as a nested compile region (a no-op in eager execution); ``marked``
    gains each class marked here, with its own ``forward`` before (None: inherited), for ``AppliedPolicy.remove()``.

    The mark must sit on the class's function: marking a per-instance bound method makes Dynamo reuse
    the first block's parameters for every block (wrong results, seen on torch 2.13).
    """
    for cls in {type(root.get_submodule(name)) for name in region.nested_blocks}:
        if cls in marked or compat.is_nested_compile_region(cls.forward):
            continue
        marked[cls] = cls.__dict__.get("forward")
        cls.forward = torch.compiler.nested_compile_region(cls.forward)
