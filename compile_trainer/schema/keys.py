"""Keys a config section does not declare, named with the nearest valid key and every valid key of the section
(``did_you_mean`` gives the nearest of any names: keys, policies, backends).

OmegaConf refuses an unknown key with "Key 'bakend' not in 'CompilePolicy'"; these checks run first, wherever a
policy comes from: a dict or YAML (``to_policy``), a bundled policy's file, a command line's overrides
(``compile_trainer.runs.hydra_configs.unknown_override_keys``). A dataclass field is a section whose keys are
checked, a ``List`` of dataclasses a list of such sections, a ``Dict`` takes any key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import cache
from typing import Any, Dict, List, Mapping, Sequence, Tuple


@cache
def _fields(schema: type) -> Dict[str, Any]:
    """Field name -> type hint of a dataclass, in declaration order."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def _unwrap(hint: Any) -> Tuple[str, Any]:
    """``("section", dataclass)``, ``("list", element hint)`` or ``("leaf", hint)`` (a ``Dict`` is a leaf: any key)."""
    if typing.get_origin(hint) is typing.Union:
        present = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = present[0] if len(present) == 1 else Any
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "section", hint
    if typing.get_origin(hint) in (list, List) and typing.get_args(hint):
        return "list", typing.get_args(hint)[0]
    return "leaf", hint


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'backend'?)`` for the choice nearest ``word``, or ``""`` when none is near."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def unknown_key_message(path: Sequence[str], schema: type, root: str = "") -> str:
    """``path``'s last key is not a field of ``schema`` (the section at ``path[:-1]`` under ``root``)."""
    valid = list(_fields(schema))
    key = str(path[-1])
    full = ".".join([*([root] if root else []), *map(str, path)])
    section = ".".join([*([root] if root else []), *map(str, path[:-1])])
    where = f"of {section}" if section else "at the top level"
    return f"unknown key {full!r}{did_you_mean(key, valid)}; valid keys {where}: {', '.join(valid)}"


def unknown_keys(values: Any, schema: type, root: str = "", path: Sequence[str] = ()) -> List[str]:
    """A message per key of ``values`` (nested dicts and lists, as YAML gives them) that ``schema`` does not
    declare; ``path`` is where ``values`` sits under ``root``."""
    problems: List[str] = []
    if not isinstance(values, Mapping):
        return problems
    fields = _fields(schema)
    for key, value in values.items():
        if key not in fields:
            problems.append(unknown_key_message([*path, key], schema, root))
        else:
            problems += _unknown_in_value(value, fields[key], root, [*path, key])
    return problems


def _unknown_in_value(value: Any, hint: Any, root: str, path: List[str]) -> List[str]:
    kind, inner = _unwrap(hint)
    if kind == "section":
        return unknown_keys(value, inner, root, path)
    if kind == "list" and isinstance(value, (list, tuple)):
        return [
            p for index, item in enumerate(value) for p in _unknown_in_value(item, inner, root, [*path, str(index)])
        ]
    return []


def unknown_dotted_key(path: Sequence[str], schema: type, root: str = "", value: Any = None) -> List[str]:
    """What is unknown in the dotted key ``root.path`` set to ``value`` (``compile.shapes.pad.bukets=[64]``,
    ``compile.rules.0.acton=full``): the key as the nested dicts and lists it stands for."""
    for key in reversed(path):
        value = [{}] * int(key) + [value] if str(key).isdigit() else {key: value}
    return unknown_keys(value, schema, root)
