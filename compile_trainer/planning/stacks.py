"""Block stacks: the containers of repeated blocks a regional rule compiles, at whatever depth they sit."""

from __future__ import annotations

from typing import List, Tuple

from torch import nn

from compile_trainer.planning.plan import relative_name
from compile_trainer.planning.reuse import FirstStep
from compile_trainer.planning.structure import BlockGroups, Stack, describe_splits, group_blocks, join_name, listed

BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_repeated_blocks(module: nn.Module, prefix: str = "") -> List[Tuple[str, List[str]]]:
    """Find containers (ModuleList/Sequential) under ``module`` whose children share one class.

    Returns ``[(container_name, [block_names])]``; does not look inside the blocks found.
    """
    found: List[Tuple[str, List[str]]] = []

    def visit(name: str, node: nn.Module) -> None:
        children = list(node.named_children())
        classes = {type(child) for _, child in children}
        if isinstance(node, BLOCK_CONTAINERS) and len(children) >= 2 and len(classes) == 1:
            found.append((name, [join_name(name, child_name) for child_name, _ in children]))
            return
        for child_name, child in children:
            visit(join_name(name, child_name), child)

    visit(prefix, module)
    return found


def find_block_stacks(
    module: nn.Module, name: str, min_reuse: float, notes: List[str], deferred: bool = False
) -> List[Stack]:
    """The block stacks a regional rule compiles under ``module`` (named ``name``), at whatever depth they sit.

    A stack whose children differ in structure (a CNN's stages, the towers of a model) is not the end of the
    search: where every child holds stacks of its own (or is a container of one block: an EfficientNet's first
    and last stages), and their blocks are reused more (blocks per graph compiled at the first step,
    ``planning.reuse``; ``deferred``: the blocks no other block shares a structure with compile after it) and at
    least ``min_reuse`` times, those are taken instead; ``notes`` says which level and why. A stack whose children
    share one structure is kept (one graph holds all of it).
    """
    stacks: List[Stack] = []
    for container, blocks in find_repeated_blocks(module, name):
        stacks += _stack_level(module, name, container, blocks, min_reuse, notes, deferred)
    return stacks


def _stack_level(
    module: nn.Module, name: str, container: str, blocks: List[str], min_reuse: float, notes: List[str],
    deferred: bool,
) -> List[Stack]:  # fmt: skip
    here = _grouped(module, name, [(container, blocks)])
    if len(here.groups) == 1:
        return [(container, blocks)]
    deeper: List[Stack] = []
    inner_notes: List[str] = []
    for block in blocks:
        child = module.get_submodule(relative_name(block, name))
        found = find_block_stacks(child, block, min_reuse, inner_notes, deferred) or _single_block(child, block)
        if not found:
            return [(container, blocks)]  # a child without blocks of its own: its compute would be left as rest
        deeper += found
    inside = _grouped(module, name, deeper)
    here_step, inside_step = FirstStep.of(here, deferred), FirstStep.of(inside, deferred)
    kind = type(module.get_submodule(relative_name(container, name))).__name__
    measured = (
        f"{container} ({kind}): {len(blocks)} {_classes(module, name, blocks)} children in {len(here.groups)} "
        f"distinct structures ({here_step.reuse:.1f} per graph); the stacks inside them "
        f"({listed([c for c, _ in deeper])}): {inside_step.describe()}{_split_by(inside)}"
    )
    if inside_step.reuse > here_step.reuse and inside_step.pays(min_reuse):
        notes.extend(inner_notes)
        notes.append(f"{measured}: compiled at that depth, the children's other parts as the rest")
        return deeper
    why = "no more reuse" if inside_step.reuse <= here_step.reuse else f"below regional_min_reuse {min_reuse:g}"
    notes.append(f"{measured}: {why}, the children are the blocks")
    return [(container, blocks)]


def _single_block(child: nn.Module, name: str) -> List[Stack]:
    """A container holding one block (an EfficientNet stage of one block) as a stack of that block; else none."""
    inner = list(child.named_children())
    return [(name, [join_name(name, inner[0][0])])] if isinstance(child, BLOCK_CONTAINERS) and len(inner) == 1 else []


def _split_by(groups: BlockGroups) -> str:
    return f"; blocks of one layout in a stack split by {describe_splits(groups.splits)}" if groups.splits else ""


def _grouped(module: nn.Module, name: str, stacks: List[Stack]) -> BlockGroups:
    relative = [(relative_name(c, name), [relative_name(b, name) for b in blocks]) for c, blocks in stacks]
    return group_blocks(module, relative, notes=False)


def _classes(module: nn.Module, name: str, blocks: List[str]) -> str:
    return "/".join(sorted({type(module.get_submodule(relative_name(b, name))).__name__ for b in blocks}))
