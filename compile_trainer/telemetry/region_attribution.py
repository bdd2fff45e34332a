"""Which region a compile belongs to, and which module's code a graph break sits in.

``apply_policy`` compiles every region through an entry function whose code name is ``compiled_region__<Class>[_n]``
(``CompiledRegion.entry_name``). A compile belongs to the region whose entry is the compiled frame itself or is on
the Python stack when the compile starts (frames that a graph break split off run below it); a lazy backward compile
shares its forward's compile id.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from compile_trainer.compiling.regions import ENTRY_PREFIX, AppliedPolicy

TORCH_DIR = str(Path(torch.__file__).resolve().parent)
APPLY_FILE = str(Path(__file__).resolve().parents[1] / "compiling" / "regions.py")


def region_labels(applied: Optional[AppliedPolicy]) -> Dict[str, Tuple[str, List[str]]]:
    """entry name -> (label, region module names). Blocks sharing an entry are labelled by their container, and
    by their indices in it where entries share a container (Swin's plain and shifted blocks: ``blocks.{0,2,4}``)."""
    groups: Dict[str, List[str]] = {}
    for item in applied.compiled if applied is not None else []:
        groups.setdefault(item.entry_name, []).append(item.region.name)
    by_container = {entry: _blocks_label(names) for entry, names in groups.items() if len(names) > 1}
    entries_per_label = collections.Counter(by_container.values())
    labels = {}
    for entry, names in groups.items():
        if len(names) == 1:
            labels[entry] = (names[0], names)
        elif entries_per_label[by_container[entry]] > 1:
            labels[entry] = (_blocks_label(names, indices=True), names)
        else:
            labels[entry] = (by_container[entry], names)
    for item in applied.compiled if applied is not None else []:
        if item.cache_entry is not None:  # a block's own entry for calls that pass a KV cache
            labels[item.cache_entry.__name__] = (f"{item.region.name} with a KV cache", [item.region.name])
    return labels


def _blocks_label(names: List[str], indices: bool = False) -> str:
    by_container: Dict[str, List[str]] = {}
    for name in names:
        container, _, index = name.rpartition(".")
        by_container.setdefault(container, []).append(index)
    labels = []
    for container, held in sorted(by_container.items()):
        within = f"{{{','.join(held)}}}" if indices else ""
        labels.append(".".join(part for part in (container, within) if part) or "<root>")
    return "+".join(labels)


def entry_on_stack() -> Optional[str]:
    """The code name of the innermost region entry on the caller's Python stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.startswith(ENTRY_PREFIX):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def user_frame(stack: list) -> Optional[Any]:
    """The innermost frame of a user stack that is neither torch's nor the policy's entry function."""
    for frame in reversed(stack or []):
        filename = str(Path(frame.filename).resolve()) if frame.filename else ""
        if filename.startswith(TORCH_DIR) or filename == APPLY_FILE or frame.name.startswith(ENTRY_PREFIX):
            continue
        return frame
    return stack[-1] if stack else None


def declared_functions(applied: Optional[AppliedPolicy], root: Optional[nn.Module]) -> List[str]:
    """Qualified names of forwards that `eager` rules disabled inside compiled regions."""
    if applied is None or root is None:
        return []
    names = set()
    for name in applied.eager_inside:
        module = root.get_submodule(name)
        names.add(type(module).forward.__qualname__)
    return sorted(names)


def owning_modules(root: Optional[nn.Module], location: str) -> str:
    """The modules whose ``forward`` holds ``location`` (``file:line``), e.g. ``model.blocks.0 (Block)``."""
    if root is None or ":" not in location:
        return ""
    filename, _, line_text = location.rpartition(":")
    if not line_text.isdigit():
        return ""
    line, best, names = int(line_text), None, []
    for name, module in root.named_modules():
        code = getattr(type(module).forward, "__code__", None)
        if code is None or code.co_filename != filename:
            continue
        lines = [number for _, _, number in code.co_lines() if number is not None]
        if not lines or not (code.co_firstlineno <= line <= max(lines)):
            continue
        span = max(lines) - code.co_firstlineno
        if best is None or span < best:
            best, names = span, [name]
        elif span == best:
            names.append(name)
    if not names:
        return ""
    cls = type(root.get_submodule(names[0])).__name__
    shown = names[0] or "<root>"
    return f"{shown} ({cls})" if len(names) == 1 else f"{shown} and {len(names) - 1} more ({cls})"
