"""Module selection: match policy rules against a module tree and resolve them into a plan.

The plan says which submodules become compiled regions (and with which settings) and which
stay eager. It is computed without compiling anything, so bad rules fail before training.
"""

from __future__ import annotations

import collections
import difflib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from torch import nn

from compile_trainer.planning.structure import (
    BlockGroups,
    Stack,
    Trial,
    describe_splits,
    group_blocks,
    join_name,
    listed,
)
from compile_trainer.schema import CompilePolicy, CompileSettings, PolicyError, Rule

BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential)


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
        return next((r for r in self.regions if _is_inside(name, r.name) and not _behind_break(name, r)), None)


def _is_inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name.startswith(ancestor + ".")


def _behind_break(name: str, region: Region) -> bool:
    return any(_is_inside(name, b) for b in region.breaks)


GLOB_WILDCARDS = "*?"  # what _glob_regex reads as a wildcard; any other character matches itself


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``*`` matches one dotted segment (or part of it), ``**`` any number of segments."""
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^.]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts) + r"\Z")


def rule_matches(rule: Rule, name: str, module: nn.Module) -> bool:
    if rule.name is not None and not _glob_regex(rule.name).match(name):
        return False
    if rule.class_name is not None and not _glob_regex(rule.class_name).match(type(module).__name__):
        return False
    return True


def _nearest(rule: Rule, modules: Dict[str, nn.Module]) -> str:
    hints = []
    if rule.name is not None:
        prefix = rule.name.split("*")[0].rsplit(".", 1)[0] if "." in rule.name else ""
        names = [n for n in modules if n]
        close = difflib.get_close_matches(rule.name, names, n=6, cutoff=0.4)
        if prefix in modules:
            children = [f"{prefix}.{c}" if prefix else c for c, _ in modules[prefix].named_children()]
            close = close + [c for c in children if c not in close]
        hints.append("nearest module names: " + ", ".join(close[:10] or names[:10]))
    if rule.class_name is not None:
        classes = sorted({type(m).__name__ for m in modules.values()})
        close = difflib.get_close_matches(rule.class_name, classes, n=6, cutoff=0.4)
        hints.append("class names in the model: " + ", ".join(close or classes[:15]))
    return "; ".join(hints)


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


def find_block_stacks(module: nn.Module, name: str, min_reuse: float, notes: List[str]) -> List[Stack]:
    """The block stacks a regional rule compiles under ``module`` (named ``name``), at whatever depth they sit.

    A stack whose children differ in structure (a CNN's stages, the towers of a model) is not the end of the
    search: where every child holds stacks of its own, and their blocks are reused more (blocks per distinct
    structure) and at least ``min_reuse`` times, those are taken instead; ``notes`` says which level and why. A
    stack whose children share one structure is kept (one graph holds all of it).
    """
    stacks: List[Stack] = []
    for container, blocks in find_repeated_blocks(module, name):
        stacks += _stack_level(module, name, container, blocks, min_reuse, notes)
    return stacks


def _stack_level(
    module: nn.Module, name: str, container: str, blocks: List[str], min_reuse: float, notes: List[str]
) -> List[Stack]:
    here = _grouped(module, name, [(container, blocks)])
    if len(here.groups) == 1:
        return [(container, blocks)]
    deeper: List[Stack] = []
    inner_notes: List[str] = []
    for block in blocks:
        found = find_block_stacks(module.get_submodule(_relative(block, name)), block, min_reuse, inner_notes)
        if not found:
            return [(container, blocks)]  # a child without blocks of its own: its compute would be left as rest
        deeper += found
    inside = _grouped(module, name, deeper)
    kind = type(module.get_submodule(_relative(container, name))).__name__
    measured = (
        f"{container} ({kind}): {len(blocks)} {_classes(module, name, blocks)} children in {len(here.groups)} "
        f"distinct structures ({here.reuse:.1f} per graph); the stacks inside them "
        f"({listed([c for c, _ in deeper])}): {len(inside.keys)} blocks in {len(inside.groups)} structures "
        f"({inside.reuse:.1f} per graph{_split_by(inside)})"
    )
    if inside.reuse > here.reuse and inside.reuse >= min_reuse:
        notes.extend(inner_notes)
        notes.append(f"{measured}: compiled at that depth, the children's other parts as the rest")
        return deeper
    why = "no more reuse" if inside.reuse <= here.reuse else f"below regional_min_reuse {min_reuse:g}"
    notes.append(f"{measured}: {why}, the children are the blocks")
    return [(container, blocks)]


def _split_by(groups: BlockGroups) -> str:
    return f"; blocks of one layout in a stack split by {describe_splits(groups.splits)}" if groups.splits else ""


def _grouped(module: nn.Module, name: str, stacks: List[Stack]) -> BlockGroups:
    relative = [(_relative(c, name), [_relative(b, name) for b in blocks]) for c, blocks in stacks]
    return group_blocks(module, relative, notes=False)


def _classes(module: nn.Module, name: str, blocks: List[str]) -> str:
    return "/".join(sorted({type(module.get_submodule(_relative(b, name))).__name__ for b in blocks}))


def _rest_roots(name: str, module: nn.Module, containers: List[str]) -> List[Tuple[str, nn.Module]]:
    """The largest subtrees under ``module`` that hold no block container and are called (a ``ModuleList`` or
    ``ModuleDict`` has no forward: its owner calls its children, which are the roots; HF ConvNeXt's downsampling)."""
    if name in containers:
        return []
    if not any(_is_inside(c, name) for c in containers) and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    roots: List[Tuple[str, nn.Module]] = []
    for child_name, child in module.named_children():
        roots.extend(_rest_roots(join_name(name, child_name), child, containers))
    return roots


def _expand_rule(
    index: int, rule: Rule, name: str, module: nn.Module, settings: CompileSettings, plan: CompilePlan,
    policy: CompilePolicy, above: List[Tuple[str, nn.Module]], trial: Optional[Trial] = None,
) -> List[Tuple[str, Optional[Region]]]:  # fmt: skip
    """What one rule does to one matched module (under the modules ``above`` it, outermost first):
    ``(name, region or None for eager)`` items."""
    if rule.action == "eager":
        return [(name, None)]
    if rule.action == "full":
        return [(name, Region(name, module, settings, index, "full"))]
    stacks = find_block_stacks(module, name, policy.regional_min_reuse, plan.notes)
    if not stacks:
        return _without_blocks(index, name, module, settings, plan)
    if rule.rest == "nested":
        blocks = [b for _, block_names in stacks for b in block_names]
        return [(name, Region(name, module, settings, index, "nested", nested_blocks=blocks))]
    modules = dict(module.named_modules(prefix=name))
    block_names = [b for _, names in stacks for b in names]
    relative = [(_relative(c, name), [_relative(b, name) for b in bs]) for c, bs in stacks]
    structure = group_blocks(module, relative, prefix=name, above=above, trial=trial)
    plan.notes.extend(structure.notes)
    reuse, min_reuse = structure.reuse, policy.regional_min_reuse
    if len(structure.groups) > 1 and reuse < min_reuse:  # one structure: one block graph, never more work
        plan.notes.append(
            f"{name} ({type(module).__name__}): {len(block_names)} blocks in {len(structure.groups)} distinct "
            f"structures, {reuse:.1f} per compiled graph (regional_min_reuse {min_reuse:g}): compiled whole, which "
            "compiles about as fast as that many graphs and runs without breaks; regional_min_reuse: 0 compiles "
            "the blocks regionally"
        )
        return [(name, Region(name, module, settings, index, "full"))]
    plan.training_without_cache.update(structure.cache_builders)
    plan.notes.extend(structure.cache_notes)
    containers = [c for c, _ in stacks]
    rest = rule.rest
    breaks = _outer_breaks(name, modules, containers) if rest in ("outer", "auto") else None
    if rest == "auto":
        rest = _auto_rest(name, modules, block_names, breaks, policy.regional_outer_min_share, plan)
    items: List[Tuple[str, Optional[Region]]] = []
    breaks = breaks if rest == "outer" else None
    if rest == "outer" and breaks is None:
        plan.notes.append(
            f"{name} ({type(module).__name__}) loops over its blocks in its own forward, so it cannot be compiled "
            "around them: its other parts are compiled as their own regions (rest: compile)"
        )
    if breaks:
        items.append((name, Region(name, module, settings, index, "outer", breaks=breaks)))
        items += [(b, None) for b in breaks]
    keys = {b: structure.keys[_relative(b, name)] for b in block_names}
    unrepeated = _unrepeated_blocks_in_background(rule.rest, modules, keys, plan)
    for b in block_names:
        block = Region(b, modules[b], settings, index, "block", structure=keys[b], background=b in unrepeated)
        block.shared_floats = list(structure.shared_floats.get(keys[b], []))
        block.indices = list(structure.indices.get(keys[b], []))
        items.append((b, block))
    if rest in ("compile", "background", "outer"):
        roots = [(name, module)] if not breaks else [(b, modules[b]) for b in breaks]
        background = rest == "background" or _inner_parts_in_background(rule.rest, breaks, plan)
        for root_name, root in roots:
            items += _rest_regions(root_name, root, containers, settings, index, plan, background)
    return items


def _inner_parts_in_background(asked: str, breaks: Optional[List[str]], plan: CompilePlan) -> bool:
    """Whether ``rest: auto``'s outer road compiles the parts inside its breaks (the eager stacks around the blocks:
    embeddings, final norms, rotary tables) on the background thread rather than at the first step, which then
    compiles the blocks and the code around the stacks only. Each such part is a small graph with a compiler's fixed
    cost (BART-base on an H100: six of them, 4.6 s of a 20 s first step; an embedding lookup or a norm run eagerly
    for the few steps until the install costs next to nothing)."""
    if asked != "auto" or not breaks or not plan.background_rest:
        return False
    plan.notes.append(
        f"the parts with weights inside {', '.join(breaks)} (run eagerly around the blocks) compiled as their own "
        "regions on a background thread after the first step; eager until then (rest: auto)"
    )
    return True


def _unrepeated_blocks_in_background(
    asked: str, modules: Dict[str, nn.Module], keys: Dict[str, str], plan: CompilePlan
) -> List[str]:
    """The blocks whose structure no other block shares (T5's first block of each stack, the only one holding the
    relative position bias), where ``rest: auto`` may compile in the background and other blocks do share a graph.
    Such a block repeats nothing, like the rest: its graph costs the first step a compile of its own that no other
    block reuses (T5-base on an H100: two of the four block structures), so it compiles on the background thread
    after the first step, which then compiles only the shared structures; eager until the install."""
    sharing = collections.Counter(keys.values())
    if asked != "auto" or not plan.background_rest or max(sharing.values()) < 2:
        return []
    unrepeated = [b for b, key in keys.items() if sharing[key] == 1]
    if unrepeated:
        classes = "/".join(sorted({type(modules[b]).__name__ for b in unrepeated}))
        plan.notes.append(
            f"{listed(unrepeated)} ({classes}): a structure no other block shares, so a graph of its own that nothing "
            "reuses: compiled on a background thread after the first step, eager until then (rest: auto)"
        )
    return unrepeated


def _without_blocks(
    index: int, name: str, module: nn.Module, settings: CompileSettings, plan: CompilePlan
) -> List[Tuple[str, Optional[Region]]]:
    """A module a regional rule matched that holds no repeated blocks at any depth: compiled whole, as one whose
    blocks share too little is."""
    plan.notes.append(
        f"{name} ({type(module).__name__}) has no repeated blocks at any depth: compiled whole (rule {index})"
    )
    return [(name, Region(name, module, settings, index, "full"))]


def _auto_rest(
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

    Otherwise ``compile`` where all of that lies in the module that runs eagerly around the blocks (the break),
    whose parts are regions either way, as in a wrapper whose ``forward`` only slices a batch for a GPT: its outer
    graphs would compile glue, and a new machine traces them again, since graphs with a break are not precompiled
    (``compile_trainer.cache.precompiled``)."""
    module, blocks = modules[name], [modules[b] for b in block_names]
    share = _share_outside(module, blocks)
    measured = (
        f"{name} ({type(module).__name__}): {share:.1%} of its parameters and buffers outside its {len(blocks)} blocks"
    )
    knob = f"regional_outer_min_share {min_share * 100:g}%"
    if share < min_share and plan.background_rest:
        plan.notes.append(
            f"{measured} (< {knob}): its parts with weights compiled as their own regions on a background thread "
            "after the first step, which compiles only the blocks; eager until then (rest: background)"
        )
        return "background"
    if share < min_share:
        plan.notes.append(
            f"{measured} (< {knob}): the code around them left eager, which compiles fewer graphs (rest: eager); "
            "rest: compile compiles each part with weights as its own region, rest: outer the code around the "
            "blocks whole; on a GPU, with no compile cache or shapes.warmup, they compile in the background "
            "(rest: background)"
        )
        return "eager"
    all_in_break = bool(breaks) and not _holds_state_around(modules, [*block_names, *breaks])
    in_break = f"all of them in {', '.join(breaks or [])}, which runs eagerly around the blocks"
    if plan.background_rest and (breaks is None or all_in_break):
        where = (
            in_break
            if breaks
            else "and it loops over its blocks in its own forward, so it cannot be compiled around them"
        )
        plan.notes.append(
            f"{measured} (>= {knob}), {where}: its parts with weights compiled as their own regions on a background "
            "thread after the first step, which compiles only the blocks; eager until then (rest: background)"
        )
        return "background"
    if all_in_break:
        plan.notes.append(
            f"{measured} (>= {knob}), {in_break}: its "
            "parts compiled as regions (rest: compile); the code around it holds no weights (rest: outer would "
            "compile glue)"
        )
        return "compile"
    plan.notes.append(
        f"{measured} (>= {knob}): compiled whole around its blocks (rest: outer), so the code around them "
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
    around = [m for n, m in modules.items() if not any(n == e or _is_inside(n, e) for e in excluded)]
    return any(True for m in around for _ in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


def _element_count(modules: List[nn.Module]) -> int:
    """Elements of the parameters and buffers under ``modules``, each tensor once (tied weights count once)."""
    tensors = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() for t in tensors.values())


def _rest_regions(
    name: str, module: nn.Module, containers: List[str], settings, index: int, plan: CompilePlan, background: bool
):
    items = []
    for rest_name, rest_module in _rest_roots(name, module, containers):
        if _has_state(rest_module):
            items.append((rest_name, Region(rest_name, rest_module, settings, index, "rest", background=background)))
        else:
            plan.notes.append(f"{rest_name} ({type(rest_module).__name__}) has no parameters: left eager")
    return items


def _outer_breaks(name: str, modules: Dict[str, nn.Module], containers: List[str]) -> Optional[List[str]]:
    """Where a module compiled around its block stacks must break: at a ``Sequential`` stack (one call), else
    at the module that loops over a ``ModuleList`` stack. None when that module is ``name`` itself."""
    breaks = []
    for container in containers:
        parent = container.rsplit(".", 1)[0] if "." in container else ""
        if isinstance(modules[container], nn.Sequential):
            breaks.append(container)
        elif parent != name and _is_inside(parent, name):
            breaks.append(parent)
        else:
            return None
    return sorted(set(breaks))


def _prefixes(name: str) -> List[str]:
    """The names of the modules above ``name``, the root (``""``) first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) + 1 :] if prefix else name


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def resolve_plan(
    root: nn.Module, policy: CompilePolicy, trial: Optional[Trial] = None, background_rest: bool = False
) -> CompilePlan:
    """Resolve ``policy``'s rules, in order, against ``root``'s submodules.

    A later rule replaces what earlier rules decided for the modules it selects and their
    subtrees; an ``eager`` module inside a compiled region becomes a graph break. A module is
    compiled at most once: a region inside another region is an error. ``trial`` (``apply_policy`` passes
    ``compiling.block_values.trial_trace``) traces one block of a group whose blocks differ in per-block values,
    so that a value the compiler specializes splits the group here; without it nothing is traced.
    ``background_rest``: ``rest: auto`` resolves to ``background`` where it would leave light parts eager
    (``apply_policy`` sets it on a GPU, where nothing else decides when compiles happen).
    """
    plan = CompilePlan(background_rest=background_rest)
    if not policy.enabled:
        return plan
    modules = dict(root.named_modules())
    candidates = {n: m for n, m in modules.items() if n}  # the root itself is never a region
    for index, rule in enumerate(policy.rules):
        matched = [(n, m) for n, m in candidates.items() if rule_matches(rule, n, m)]
        if not matched:
            raise PolicyError(f"rule {index} {rule.describe()} matches no module; {_nearest(rule, modules)}.")
        settings = policy.settings.overridden_by(rule)
        weightless = [n for n, m in matched if _skips_weightless(rule) and not _has_state(m)]
        if weightless:  # a loss, a metric: nothing to compile (a metric's update would recompile at every step)
            plan.notes.append(f"{listed(weightless)}: no parameters or buffers, left eager (rule {index})")
        for name, module in matched:
            if name in weightless:
                continue
            above = [(n, modules[n]) for n in _prefixes(name)]
            for item_name, region in _expand_rule(index, rule, name, module, settings, plan, policy, above, trial):
                _place(plan, index, item_name, region, policy.rules)
    plan.regions.sort(key=lambda r: list(modules).index(r.name))
    return plan


def _skips_weightless(rule: Rule) -> bool:
    """A regional rule, or a full one that selects by a name pattern (``*``: every top-level submodule), leaves a
    module without parameters or buffers eager; a full rule that names the module compiles it as asked."""
    return rule.action == "regional" or (rule.action == "full" and any(c in (rule.name or "") for c in GLOB_WILDCARDS))


def _place(plan: CompilePlan, index: int, name: str, region: Optional[Region], rules: List[Rule]) -> None:
    plan.regions = [r for r in plan.regions if not (r.name == name or _is_inside(r.name, name))]
    plan.eager = {n: i for n, i in plan.eager.items() if not (n == name or _is_inside(n, name))}
    outer = plan.enclosing_region(name)
    if region is None:
        plan.eager[name] = index
        return
    if outer is not None:
        raise PolicyError(_inside_region_message(index, name, outer, rules))
    plan.regions.append(region)


def _inside_region_message(index: int, name: str, outer: Region, rules: List[Rule]) -> str:
    """Why rule ``index`` cannot make ``name`` a region (it lies inside ``outer``), and the valid fixes."""
    by = f"rule {outer.rule_index} {rules[outer.rule_index].describe()}"
    narrow = f"narrow rule {index} to modules outside compiled regions (under a module an `eager` rule leaves eager)"
    if outer.role == "block":
        what = (
            f"a repeated block that {by} compiles whole (one graph for the blocks of its structure); a part of a "
            f"compiled block cannot be a region of its own. Valid: select the whole block in rule {index} (it is then "
            f"compiled alone, with rule {index}'s settings), give the settings to rule {outer.rule_index} (every block "
            f"gets them), {narrow}, or drop one rule"
        )
    elif outer.role == "rest":
        what = (
            f"a part that {by} compiles whole as one region (rest: {rules[outer.rule_index].rest}). Valid: select "
            f"{outer.name!r} itself in rule {index}, {narrow}, or drop one rule"
        )
    elif outer.role == "outer":
        what = (
            f"which {by} compiles whole around its blocks (rest: outer). Valid: rest: compile in rule "
            f"{outer.rule_index} (each part becomes a region that a later rule can replace), {narrow}, or drop one rule"
        )
    else:
        what = (
            f"which {by} compiles whole. Valid: make rule {outer.rule_index} 'regional' (its blocks and other parts "
            f"become regions that a later rule can replace), {narrow}, or drop one rule"
        )
    return (
        f"rule {index} {rules[index].describe()} would compile {name!r} inside {outer.name!r}, {what}. A module is "
        "compiled at most once."
    )
