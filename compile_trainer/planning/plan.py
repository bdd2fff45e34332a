"""The plan's data: the regions a policy's rules resolved to, the modules left eager, and the notes saying why;
with the relations between module names that the planning reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torch import nn

from compile_trainer.schema import CompileSettings


@dataclass
class Region:
    """A submodule compiled in place as one unit."""

    name: str
    module: nn.Module
    settings: CompileSettings
    rule_index: int
    # "full"; "block" (a repeated block); "rest" (a non-repeated part of a regional rule); "outer" (a module
    # compiled whole around its block stack, which runs eagerly: ``breaks``); or "nested" (a module compiled
    # whole whose repeated blocks, ``nested_blocks``, are nested compile regions)
    role: str
    nested_blocks: List[str] = field(default_factory=list)
    # Modules inside an "outer" region that run eagerly (graph breaks); regions inside them are their own.
    breaks: List[str] = field(default_factory=list)
    # Blocks with equal keys share one compiled entry (``planning.structure``).
    structure: str = ""
    # For a block: float attributes (paths in the block) that differ between the blocks sharing its entry, passed
    # to the graph as inputs; index attributes left out of its key (read only to address a KV cache: a call that
    # passes a cache runs an entry of the block's own). A trial trace put those the compiler specializes back into
    # the key; the first compile watches the rest (``compiling.block_values.SharedValues``).
    shared_floats: List[str] = field(default_factory=list)
    indices: List[str] = field(default_factory=list)
    # Compiled on a background thread after the first step, eager until then: a "rest" region (rest: background, or
    # rest: auto's parts inside an outer region's breaks), or a block whose structure no other block shares
    background: bool = False

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


@dataclass
class CompilePlan:
    """The resolved plan: compiled regions and modules that must stay eager."""

    regions: List[Region] = field(default_factory=list)
    # qualified name -> index of the rule that made it eager
    eager: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    # module whose training forwards run without a KV cache (``use_cache=False`` unless asked) -> the decoder
    # class whose config builds one (``planning.structure.cache_builder``)
    training_without_cache: Dict[str, str] = field(default_factory=dict)
    # Whether ``rest: auto`` may compile light parts in the background (``resolve_plan``'s ``background_rest``).
    background_rest: bool = False

    def region_names(self) -> List[str]:
        return [region.name for region in self.regions]

    def enclosing_region(self, name: str) -> Optional[Region]:
        """The region whose compiled code runs ``name``'s forward (a module behind an outer region's break
        runs its own)."""
        return next((r for r in self.regions if is_inside(name, r.name) and not _behind_break(name, r)), None)


def is_inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name.startswith(ancestor + ".")


def _behind_break(name: str, region: Region) -> bool:
    return any(is_inside(name, b) for b in region.breaks)


def relative_name(name: str, prefix: str) -> str:
    """``name`` as seen from the module named ``prefix`` (``""``: the root)."""
    return name[len(prefix) + 1 :] if prefix else name
