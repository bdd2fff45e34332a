"""Module selection: match policy rules against a module tree and resolve them into a plan.

The plan says which submodules become compiled regions (and with which settings) and which
stay eager. It is computed without compiling anything, so bad rules fail before training.
Matching a rule is ``planning.rules``; finding block stacks ``planning.stacks``; what becomes of a regional
rule's other parts ``planning.rest``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

from compile_trainer.planning.plan import CompilePlan, Region, is_inside, relative_name
from compile_trainer.planning.rest import (
    auto_rest,
    has_state,
    inner_parts_in_background,
    outer_breaks,
    rest_regions,
)
from compile_trainer.planning.reuse import FirstStep, deferred_note, defers_unshared, unshared_blocks, whole_note
from compile_trainer.planning.rules import nearest_matches, rule_matches, skips_weightless
from compile_trainer.planning.stacks import find_block_stacks
from compile_trainer.planning.structure import BlockGroups, Trial, group_blocks, listed
from compile_trainer.schema import CompilePolicy, CompileSettings, PolicyError, Rule


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
    deferred = defers_unshared(rule.rest, plan.background_rest)
    stacks = find_block_stacks(module, name, policy.regional_min_reuse, plan.notes, deferred)
    if not stacks:
        return _without_blocks(index, name, module, settings, plan)
    if rule.rest == "nested":
        blocks = [b for _, block_names in stacks for b in block_names]
        return [(name, Region(name, module, settings, index, "nested", nested_blocks=blocks))]
    modules = dict(module.named_modules(prefix=name))
    block_names = [b for _, names in stacks for b in names]
    relative = [(relative_name(c, name), [relative_name(b, name) for b in bs]) for c, bs in stacks]
    structure = group_blocks(module, relative, prefix=name, above=above, trial=trial)
    step = FirstStep.of(structure, deferred)
    if not step.pays(policy.regional_min_reuse):
        plan.notes.extend(structure.specialized_notes)  # still why; the structures' entries no longer apply
        plan.notes.append(whole_note(name, module, step, policy.regional_min_reuse))
        return [(name, Region(name, module, settings, index, "full"))]
    plan.notes.extend(structure.notes)
    plan.training_without_cache.update(structure.cache_builders)
    plan.notes.extend(structure.cache_notes)
    containers = [c for c, _ in stacks]
    rest = rule.rest
    breaks = outer_breaks(name, modules, containers) if rest in ("outer", "auto") else None
    if rest == "auto":
        rest = auto_rest(name, modules, block_names, breaks, policy.regional_outer_min_share, plan)
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
    items += _block_regions(index, rule, name, modules, block_names, settings, structure, plan, step)
    if rest in ("compile", "background", "outer"):
        roots = [(name, module)] if not breaks else [(b, modules[b]) for b in breaks]
        background = rest == "background" or inner_parts_in_background(rule.rest, breaks, modules, containers, plan)
        for root_name, root in roots:
            items += rest_regions(root_name, root, containers, settings, index, background)
    return items


def _block_regions(
    index: int, rule: Rule, name: str, modules: Dict[str, nn.Module], block_names: List[str],
    settings: CompileSettings, structure: BlockGroups, plan: CompilePlan, step: FirstStep,
) -> List[Tuple[str, Optional[Region]]]:  # fmt: skip
    """A region per block of a regional rule's stacks, keyed by its structure, with its per-block values; the blocks
    no other block shares a structure with compile in the background where ``step`` defers them."""
    keys = {b: structure.keys[relative_name(b, name)] for b in block_names}
    deferred = unshared_blocks(keys) if step.deferred else []
    if deferred:
        plan.notes.append(deferred_note(step, deferred, modules, rule.rest))
    items: List[Tuple[str, Optional[Region]]] = []
    for b in block_names:
        block = Region(b, modules[b], settings, index, "block", structure=keys[b], background=b in deferred)
        block.shared_floats = list(structure.shared_floats.get(keys[b], []))
        block.indices = list(structure.indices.get(keys[b], []))
        items.append((b, block))
    return items


def _without_blocks(
    index: int, name: str, module: nn.Module, settings: CompileSettings, plan: CompilePlan
) -> List[Tuple[str, Optional[Region]]]:
    """A module a regional rule matched that holds no repeated blocks at any depth: compiled whole, as one whose
    blocks share too little is."""
    plan.notes.append(
        f"{name} ({type(module).__name__}) has no repeated blocks at any depth: compiled whole (rule {index})"
    )
    return [(name, Region(name, module, settings, index, "full"))]


def _prefixes(name: str) -> List[str]:
    """The names of the modules above ``name``, the root (``""``) first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


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
            raise PolicyError(f"rule {index} {rule.describe()} matches no module; {nearest_matches(rule, modules)}.")
        settings = policy.settings.overridden_by(rule)
        weightless = [n for n, m in matched if skips_weightless(rule) and not has_state(m)]
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


def _place(plan: CompilePlan, index: int, name: str, region: Optional[Region], rules: List[Rule]) -> None:
    plan.regions = [r for r in plan.regions if not (r.name == name or is_inside(r.name, name))]
    plan.eager = {n: i for n, i in plan.eager.items() if not (n == name or is_inside(n, name))}
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
