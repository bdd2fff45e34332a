"""The rest of a regional rule: what becomes of a module's parts outside its block stacks (``rest``: eager,
compile, outer, background, or ``auto``, which picks one by the share of weights outside the blocks)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

from compile_trainer.planning.plan import CompilePlan, Region, is_inside
from compile_trainer.planning.structure import join_name
from compile_trainer.schema import CompileSettings


def _rest_roots(name: str, module: nn.Module, containers: List[str]) -> List[Tuple[str, nn.Module]]:
    """The largest subtrees under ``module`` that hold no block container and are called (a ``ModuleList`` or
    ``ModuleDict`` has no forward: its owner calls its children, which are the roots; HF ConvNeXt's downsampling)."""
    if name in containers:
        return []
    if not any(is_inside(c, name) for c in containers) and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    roots: List[Tuple[str, nn.Module]] = []
    for child_name, child in module.named_children():
        roots.extend(_rest_roots(join_name(name, child_name), child, containers))
    return roots


def inner_parts_in_background(
    asked: str, breaks: Optional[List[str]], modules: Dict[str, nn.Module], containers: List[str], plan: CompilePlan
) -> bool:
    """Whether ``rest: auto``'s outer road compiles the parts inside its breaks (the eager stacks around the blocks:
    embeddings, final norms, rotary tables) on the background thread rather than at the first step, which then
    compiles the blocks and the code around the stacks only. Each such part is a small graph with a compiler's fixed
    cost (BART-base on an H100: six of them, 4.6 s of a 20 s first step; an embedding lookup or a norm run eagerly
    for the few steps until the install costs next to nothing)."""
    if asked != "auto" or not breaks or not plan.background_rest:
        return False
    parts = [part for b in breaks for _, part in _rest_roots(b, modules[b], containers) if has_state(part)]
    if not parts:  # the breaks hold the blocks alone (an EfficientNet's stages)
        return False
    plan.notes.append(
        f"the parts with weights inside {', '.join(breaks)} (run eagerly around the blocks) compiled as their own "
        "regions on a background thread after the first step; eager until then (rest: auto)"
    )
    return True


def auto_rest(
    name: str,
    modules: Dict[str, nn.Module],
    block_names: List[str],
    breaks: Optional[List[str]],
    min_share: float,
    plan: CompilePlan,
) -> str:
    """``rest: auto``: ``outer`` where enough of the module lives outside its blocks for the code around them
    (embeddings, head, a loss on large logits) to be worth compiling whole, else ``eager``: compiling light code
    around the blocks costs graphs (the outer road: a prefix and a resume graph per Python frame down to the break;
    ``compile``: one per part) that its speed-up does not repay (ViT-B/16 on an H100: first step 0.42 of the full
    compile's with it eager, 0.48-0.59 compiled; throughput 0.967-0.986). Where ``plan.background_rest``, those
    light parts are compiled as their own regions on a background thread instead (``background``): the first step
    still compiles only the blocks, and the steps after the install run the parts compiled (ConvNeXt-T on an H100:
    its eager LayerNorms and layout copies cost 1.5-2 ms of a 19 ms step). So are the heavy parts where no outer
    region can hold them (``compile`` below, or a module that loops over its own blocks): the first compiled graph
    carries the process's one-time compiler costs, and compiling the embeddings and head first made the recipe's
    GPT-2 small wait for three graphs at its first step (H100: 2.9-3.5 s embed, 3.2-3.9 s blocks, 2.1-2.4 s head).

    Otherwise ``compile`` where no outer region can hold the parts: the module loops over its blocks in its own
    forward, or all of that lies in the module that runs eagerly around the blocks (the break), whose parts are
    regions either way, as in a wrapper whose ``forward`` only slices a batch for a GPT: its outer
    graphs would compile glue, and a new machine traces them again, since graphs with a break are not precompiled
    (``compile_trainer.cache.precompiled``)."""
    module, blocks = modules[name], [modules[b] for b in block_names]
    share = _share_outside(module, blocks)
    measured = (
        f"{name} ({type(module).__name__}): {share:.1%} of its parameters and buffers outside its {len(blocks)} blocks"
    )
    knob = f"regional_outer_min_share {min_share * 100:g}%"
    if share == 0:  # nothing with weights around the blocks: no part to compile, nothing to say
        return "eager"
    if share < min_share:
        return _light_rest(f"{measured} (< {knob})", plan)
    return _heavy_rest(f"{measured} (>= {knob})", modules, block_names, breaks, plan)


def _light_rest(measured: str, plan: CompilePlan) -> str:
    """``auto_rest`` where the weights outside the blocks fall short of the share (``measured`` says by how much)."""
    if plan.background_rest:
        plan.notes.append(
            f"{measured}: its parts with weights compiled as their own regions on a background thread "
            "after the first step, which compiles only the blocks; eager until then (rest: background)"
        )
        return "background"
    plan.notes.append(f"{measured}: the code around them left eager, which compiles fewer graphs (rest: eager)")
    return "eager"


def _heavy_rest(
    measured: str, modules: Dict[str, nn.Module], block_names: List[str], breaks: Optional[List[str]], plan: CompilePlan
) -> str:
    """``auto_rest`` where the weights outside the blocks reach the share (``measured`` says how much)."""
    all_in_break = bool(breaks) and not _holds_state_around(modules, [*block_names, *breaks])
    in_break = f"all of them in {', '.join(breaks or [])}, which runs eagerly around the blocks"
    if plan.background_rest and (breaks is None or all_in_break):
        where = (
            in_break
            if breaks
            else "and it loops over its blocks in its own forward, so it cannot be compiled around them"
        )
        plan.notes.append(
            f"{measured}, {where}: its parts with weights compiled as their own regions on a background "
            "thread after the first step, which compiles only the blocks; eager until then (rest: background)"
        )
        return "background"
    if breaks is None:
        plan.notes.append(
            f"{measured}, and it loops over its blocks in its own forward, so it cannot be compiled around them: "
            "its parts with weights compiled as their own regions (rest: compile)"
        )
        return "compile"
    if all_in_break:
        plan.notes.append(
            f"{measured}, {in_break}: its "
            "parts compiled as regions (rest: compile); the code around it holds no weights (rest: outer would "
            "compile glue)"
        )
        return "compile"
    plan.notes.append(
        f"{measured}: compiled whole around its blocks (rest: outer), so the code around them "
        "(loss, head) is compiled too"
    )
    return "outer"


def _share_outside(module: nn.Module, blocks: List[nn.Module]) -> float:
    """The share of ``module``'s parameter and buffer elements that no block holds (0 for a stateless module)."""
    total = _element_count([module])
    return 1 - _element_count(blocks) / total if total else 0.0


def _holds_state_around(modules: Dict[str, nn.Module], excluded: List[str]) -> bool:
    """Whether a module of ``modules`` outside ``excluded`` (and the modules under them) has a parameter or buffer
    of its own."""
    around = [m for n, m in modules.items() if not any(n == e or is_inside(n, e) for e in excluded)]
    return any(True for m in around for _ in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


def _element_count(modules: List[nn.Module]) -> int:
    """Elements of the parameters and buffers under ``modules``, each tensor once (tied weights count once)."""
    tensors = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() for t in tensors.values())


def rest_regions(
    name: str, module: nn.Module, containers: List[str], settings: CompileSettings, index: int, background: bool
) -> List[Tuple[str, Optional[Region]]]:
    """The regions of a regional rule's rest under ``name``: a region per root of the rest that holds weights."""
    items: List[Tuple[str, Optional[Region]]] = []
    for rest_name, rest_module in _rest_roots(name, module, containers):
        if has_state(rest_module):  # a part without weights (dropout, an activation) runs eagerly: no region
            items.append((rest_name, Region(rest_name, rest_module, settings, index, "rest", background=background)))
    return items


def outer_breaks(name: str, modules: Dict[str, nn.Module], containers: List[str]) -> Optional[List[str]]:
    """Where a module compiled around its block stacks must break: at a ``Sequential`` stack (one call), else
    at the module that loops over a ``ModuleList`` stack; at a ``Sequential`` whose children all break (an
    EfficientNet's stages: one break, not one per stage in its loop). None when that module is ``name`` itself."""
    breaks = []
    for container in containers:
        parent = container.rsplit(".", 1)[0] if "." in container else ""
        if isinstance(modules[container], nn.Sequential):
            breaks.append(container)
        elif parent != name and is_inside(parent, name):
            breaks.append(parent)
        else:
            return None
    return _whole_sequentials(name, modules, sorted(set(breaks)))


def _whole_sequentials(name: str, modules: Dict[str, nn.Module], breaks: List[str]) -> List[str]:
    """``breaks`` with the children of a ``Sequential`` inside ``name`` that all break replaced by it, repeatedly."""
    parents = {b.rsplit(".", 1)[0] for b in breaks if "." in b}
    for parent in sorted(p for p in parents if is_inside(p, name) and isinstance(modules[p], nn.Sequential)):
        children = [join_name(parent, child) for child, _ in modules[parent].named_children()]
        if all(child in breaks for child in children):
            kept = [b for b in breaks if not is_inside(b, parent)]
            return _whole_sequentials(name, modules, sorted([*kept, parent]))
    return breaks


def has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
