"""What a regional rule's blocks cost at the first step: the graphs compiled then against the blocks they stand for.

A whole-module compile traces every block; a regional one compiles a graph per distinct block structure
(``planning.structure``), each with a compiler's fixed cost. The blocks pay where each graph compiled at the first
step stands for at least ``regional_min_reuse`` (3) of them; below that the module is compiled whole (timm's
ResNet-50 with all 8 of its structures compiled at the first step: 78 s against the whole compile's 39 s on an H100).

Where the blocks whose structure no other block shares compile on a background thread after the first step
(``rest: background``, or ``rest: auto`` on a GPU: ``deferred``), only the shared structures' graphs are compiled at
the first step: timm's Swin-T (12 blocks in 7 structures: each stage alternates plain and shifted windows, the last
stage's two blocks are alike) compiles 3 graphs for its 12 blocks (4.0 per graph), EfficientNet-B0 (16 blocks in 12
structures: each stage opens with a block of its own) 3 graphs (5.3 per graph), ResNet-50 4 graphs (4.0). Without the
thread every structure compiles at the first step (Swin-T: 1.7 blocks per graph), and such models are compiled whole.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, List

from torch import nn

from compile_trainer.planning.structure import BlockGroups, listed


def defers_unshared(rest: str, background_rest: bool) -> bool:
    """Whether a regional rule's blocks whose structure no other block shares compile on the background thread:
    ``rest: background``, or ``rest: auto`` where the plan may compile in the background (a GPU)."""
    return rest == "background" or (rest == "auto" and background_rest)


@dataclass(frozen=True)
class FirstStep:
    """The graphs a regional rule's blocks compile at the first step."""

    blocks: int
    structures: int
    shared: int  # structures that two or more blocks share
    unshared: int  # blocks whose structure no other block shares
    deferred: bool  # those blocks compile on the background thread (``defers_unshared``)

    @classmethod
    def of(cls, groups: BlockGroups, deferred: bool) -> FirstStep:
        sizes = [len(members) for members in groups.groups.values()]
        shared = sum(size > 1 for size in sizes)
        return cls(len(groups.keys), len(sizes), shared, len(sizes) - shared, deferred and shared > 0)

    @property
    def graphs(self) -> int:
        """Block graphs compiled at the first step: the shared structures' where the others are deferred."""
        return self.shared if self.deferred and self.unshared else self.structures

    @property
    def reuse(self) -> float:
        """Blocks per graph compiled at the first step."""
        return self.blocks / max(self.graphs, 1)

    def describe(self) -> str:
        """``18 blocks in 4 structures (4.5 per graph)``, or where the unshared blocks are deferred ``12 blocks in 7
        structures, 3 of them shared: 3 graphs at the first step (4.0 blocks per graph), 4 blocks no other block shares
        a structure with on a background thread after it``."""
        counted = f"{self.blocks} blocks in {self.structures} structures"
        if self.graphs == self.structures:
            return f"{counted} ({self.reuse:.1f} per graph)"
        return (
            f"{counted}, {self.shared} of them shared: {_count(self.graphs, 'graph')} at the first step "
            f"({self.reuse:.1f} blocks per graph), {_count(self.unshared, 'block')} no other block shares a structure "
            "with on a background thread after it"
        )

    def pays(self, min_reuse: float) -> bool:
        """Whether compiling the blocks regionally beats compiling their module whole at the first step: one
        structure (one graph, never more work than the whole), or at least ``min_reuse`` blocks per graph."""
        return self.structures <= 1 or self.reuse >= min_reuse


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"


def unshared_blocks(keys: Dict[str, str]) -> List[str]:
    """The blocks (of ``keys``: block -> structure key) whose structure no other block shares."""
    sharing = collections.Counter(keys.values())
    return [block for block, key in keys.items() if sharing[key] == 1]


def whole_note(name: str, module: nn.Module, step: FirstStep, min_reuse: float) -> str:
    """Why a regional rule compiles ``module`` whole: its blocks' graphs at the first step stand for too few."""
    return (
        f"{name} ({type(module).__name__}): {step.describe()}, below regional_min_reuse {min_reuse:g}: compiled whole, "
        "which compiles about as fast as that many graphs and runs without breaks; regional_min_reuse: 0 compiles the "
        "blocks regionally"
    )


def deferred_note(step: FirstStep, blocks: List[str], modules: Dict[str, nn.Module], rest: str) -> str:
    """What becomes of the blocks whose structure no other block shares, where they are deferred."""
    classes = "/".join(sorted({type(modules[b]).__name__ for b in blocks}))
    return (
        f"{listed(blocks)} ({classes}): a structure no other block shares, so a graph of its own that nothing reuses: "
        f"compiled on a background thread after the first step, eager until then (rest: {rest}; {step.describe()})"
    )
