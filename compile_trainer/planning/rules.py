"""Rule matching: which submodules a rule's name and class patterns select, and the nearest names when it
selects none."""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Dict

from torch import nn

from compile_trainer.schema import Rule

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


def nearest_matches(rule: Rule, modules: Dict[str, nn.Module]) -> str:
    """Module and class names of ``modules`` near ``rule``'s patterns, for the error of a rule that matches none."""
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


def skips_weightless(rule: Rule) -> bool:
    """A regional rule, or a full one that selects by a name pattern (``*``: every top-level submodule), leaves a
    module without parameters or buffers eager; a full rule that names the module compiles it as asked."""
    return rule.action == "regional" or (rule.action == "full" and any(c in (rule.name or "") for c in GLOB_WILDCARDS))
