"""The plan as the console and a logger show it: rows per selected module, and the fixed-width table printed at
the start of training. Reads an ``AppliedPolicy``; changes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from torch import nn

from compile_trainer.tables import plural, text_table

if TYPE_CHECKING:
    from compile_trainer.compiling.regions import AppliedPolicy

ROLE_ACTIONS = {
    "full": "full",
    "block": "regional block",
    "rest": "regional rest",
    "outer": "regional outer",
    "nested": "full, nested blocks",
}


def plan_rows(applied: AppliedPolicy) -> List[Dict[str, Any]]:
    """The plan as table rows: one per selected module."""
    shared = applied.shared_counts()
    rows = []
    for item in applied.compiled:
        region, settings = item.region, _describe_kwargs(item.compile_kwargs)
        rows.append(
            _row(
                region.name,
                region.module,
                ROLE_ACTIONS[region.role] + (" (background)" if region.background else ""),
                region.rule_index,
                settings,
                shared[item.entry_name],
            )
        )
        blocks = [applied.root.get_submodule(name) for name in region.nested_blocks]
        for name, block in zip(region.nested_blocks, blocks):
            same_class = sum(type(other) is type(block) for other in blocks)
            rows.append(_row(name, block, "nested block", region.rule_index, settings, same_class))
    for name, rule_index in applied.plan.eager.items():
        action = "eager (graph break)" if name in applied.eager_inside else "eager"
        rows.append(_row(name, applied.root.get_submodule(name), action, rule_index, "-", None))
    return rows


def _row(
    name: str, module: nn.Module, action: str, rule: int, settings: str, shared_by: Optional[int]
) -> Dict[str, Any]:
    """A row of the plan; ``shared_by``: the regions that run the row's compiled entry (None: eager, no entry)."""
    return {
        "module": name,
        "class": type(module).__name__,
        "action": action,
        "rule": rule,
        "settings": settings,
        "shares_graph_with": shared_by,
    }


def _describe_kwargs(kwargs: Dict[str, Any]) -> str:
    """The settings a region is compiled with; a mode only for Inductor, the one backend that takes one."""
    text = f"backend={kwargs['backend']}"
    if kwargs["backend"] == "inductor":
        text += f" mode={kwargs['mode'] or 'default'}"
    if kwargs["fullgraph"]:
        text += " fullgraph"
    if kwargs["dynamic"] is not None:
        text += f" dynamic={kwargs['dynamic']}"
    if kwargs["options"]:
        text += f" options={kwargs['options']}"
    return text


def format_plan_table(applied: AppliedPolicy) -> str:
    """A fixed-width table of the plan, for the console."""
    rows = plan_rows(applied)
    header = f"compile policy {applied.policy.name!r}"
    if not applied.policy.enabled:
        return f"{header}: disabled, the model runs eagerly"
    if not applied.policy.rules:
        return f"{header}: no module rules, the model runs eagerly (the optimizer section still applies)"
    columns = ["module", "class", "action", "rule", "settings"]
    titles = ["module", "class", "action", "rule", "settings", "shared by"]
    cells = [[*(str(row[c]) for c in columns), _shared_by(row["shares_graph_with"])] for row in rows]
    lines = [header, *text_table(titles, cells)]
    regions, entries = len(applied.compiled), len(applied.shared_counts())
    shared = "; shared by: the regions that run one compiled entry" if regions > entries else ""
    lines.append(f"{plural(regions, 'region')}, {plural(entries, 'compiled entry', 'compiled entries')}{shared}")
    lines += _background_lines(applied)
    lines += [f"note: {note}" for note in applied.notes]
    return "\n".join(lines)


def _shared_by(count: Optional[int]) -> str:
    """The plan's ``shared by`` cell: the regions that run the row's compiled entry, ``-`` where none shares it."""
    return str(count) if count is not None and count > 1 else "-"


def _background_lines(applied: AppliedPolicy) -> List[str]:
    """What compiles on a background thread, and where Inductor lowers its graphs (none: nothing does)."""
    lowering = ""
    if applied.uses_inductor:
        configured = applied.policy.background_lowering
        where = "in its compile subprocess" if applied.background_lowering == "subprocess" else "on the thread"
        resolved = f": {applied.background_lowering}" if configured == "auto" else ""
        lowering = f", Inductor's lowering {where} (background_lowering: {configured}{resolved})"
    deferred = [item.region.name for item in applied.background_parts]
    asked = sorted({applied.policy.rules[item.region.rule_index].rest for item in applied.background_parts})
    setting = "background: true" if applied.policy.background else f"rest: {'/'.join(asked)}"
    if applied.defers_compiles and applied.foreground_reason is not None:
        return [f"{setting}, compiled in the foreground: {applied.foreground_reason}"]
    if applied.policy.background:
        return [f"compiled on a background thread while the first steps run eagerly (background: true){lowering}"]
    if deferred:
        return [
            f"{', '.join(deferred)}: compiled on a background thread after the first step, eager until then "
            f"({setting}){lowering}"
        ]
    return []
