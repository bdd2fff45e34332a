"""Which repeated blocks can share one compiled graph: grouped by structure, not by class alone.

Dynamo compiles a block's code once per set of guards. With parameters as graph inputs (the default since
torch 2.5), blocks of one class share a graph when their parameter and buffer shapes, their submodule layout
and the plain Python values their ``forward`` reads (an int used in control flow, a stride, a flag) are equal; a
block that differs in any of them would recompile the shared entry, once per variant, until ``recompile_limit``
leaves the rest running eagerly (timm's ResNet: one downsampling block per stage, four widths).
``structure_key`` captures all three, so blocks that differ get entries of their own.

Two kinds of per-block value are left out of the key, so that they do not split a stack:

- a per-block index (``layer_idx``), distinct in every block of a stack (found per stack: T5's encoder and
  decoder both count from 0). Hugging Face layers read it only to address a KV cache: a decoder whose config
  has ``use_cache`` on (its default) builds one in training too, so ``cache_builders`` names the module whose
  training forwards run without it; calls that do pass a cache (evaluation, generation) get a graph per block
  (``compiling.block_values``);
- a float that differs between blocks of one structure (a stochastic-depth probability, a per-layer scale): the
  blocks share one graph with the value as a graph input (a symbolic float, ``compiling.block_values``). A float
  that is zero in some blocks and not in others still splits them (``if p == 0`` takes another branch).

Either goes back into the key where a trial trace of one block (``group_blocks``' ``trial``) shows that the
compiler specializes it: an entry per value.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch import nn

PLAIN = (bool, int, float, str, type(None))
INDEX_NAMES = ("idx", "index", "layer_id", "block_id", "layer_number")
DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")

Stack = Tuple[str, List[str]]  # (container name, block names), relative to the module grouped
# A trial trace of one block (``compiling.block_values.trial_trace``): (block, differing floats, indices) ->
# (path -> the guard that pins its value, or why no trace was made)
Trial = Callable[[nn.Module, Sequence[str], Sequence[str]], Tuple[Dict[str, str], Optional[str]]]


def plain_attributes(module: nn.Module) -> Dict[str, Any]:
    """Plain Python values held by ``module`` and its submodules (``"self_attn.layer_idx": 3``)."""
    values: Dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        for name, value in vars(sub).items():
            if name.startswith("_") or name == "training":
                continue
            if isinstance(value, PLAIN) or (isinstance(value, tuple) and all(isinstance(v, PLAIN) for v in value)):
                values[f"{prefix}.{name}" if prefix else name] = value
    return values


def tensor_layout(module: nn.Module) -> Tuple[Any, ...]:
    """Submodule classes, parameter and buffer shapes and dtypes: what the compiled graph's inputs look like."""
    modules = tuple((name, type(sub).__qualname__) for name, sub in module.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    return modules, params, buffers


def index_attributes(blocks: Sequence[nn.Module]) -> List[str]:
    """Attributes that look like a per-block index: an int named like one, distinct in every block."""
    if len(blocks) < 2:
        return []
    per_block = [plain_attributes(block) for block in blocks]
    found = []
    for path in per_block[0]:
        values = [attrs.get(path) for attrs in per_block]
        leaf = path.rsplit(".", 1)[-1].lower()
        is_int = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        if is_int and len(set(values)) == len(values) and any(word in leaf for word in INDEX_NAMES):
            found.append(path)
    return found


def kv_cache_config(ancestors: Sequence[nn.Module]) -> Optional[str]:
    """The Hugging Face decoder above the blocks whose config builds a KV cache in training, or None.

    Decoders (``*ForCausalLM``, ``*LMHeadModel``, ``config.is_decoder``) build one whenever ``use_cache`` is on;
    encoders (BERT, ViT) never do, whatever their config says.
    """
    configured = [m for m in ancestors if hasattr(getattr(m, "config", None), "use_cache")]
    if not configured or not configured[-1].config.use_cache:
        return None
    decoders = [
        m for m in configured if getattr(m.config, "is_decoder", False) or type(m).__name__.endswith(DECODER_SUFFIXES)
    ]
    return type(decoders[0]).__name__ if decoders else None


def _float_marker(value: float) -> str:
    """What of a float stays in the structure key: whether it is zero (a branch), or the value itself where
    Dynamo always specializes it (nan, inf)."""
    if not math.isfinite(value):
        return repr(value)
    return "float == 0" if value == 0 else "float != 0"


def structure_key(block: nn.Module, ignored: Sequence[str] = ()) -> str:
    """Blocks with equal keys can share one compiled graph: class, tensor layout and plain values (floats by
    ``_float_marker`` only; ``ignored`` attributes left out)."""
    attributes = tuple(
        sorted(
            (k, _float_marker(v) if type(v) is float else repr(v))
            for k, v in plain_attributes(block).items()
            if k not in ignored
        )
    )
    return repr((type(block).__qualname__, tensor_layout(block), attributes))


@dataclass
class BlockGroups:
    """The blocks of one regional rule, grouped into sets that share one compiled graph."""

    keys: Dict[str, str] = field(default_factory=dict)  # block name -> structure key
    # structure key -> float attributes (paths in the block) whose values differ within the group: graph inputs
    shared_floats: Dict[str, List[str]] = field(default_factory=dict)
    # structure key -> index attributes left out of the key (read only to address a KV cache)
    indices: Dict[str, List[str]] = field(default_factory=dict)
    # module (qualified name in the model) whose training forwards should build no KV cache -> the decoder class
    # whose config builds one
    cache_builders: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    # of ``notes``, why blocks differ in a value the compiler specializes (still true of a module compiled whole)
    specialized_notes: List[str] = field(default_factory=list)
    # what running ``cache_builders``' training forwards without a KV cache does (true only if the blocks stay
    # regional: a module compiled whole keeps its config's cache)
    cache_notes: List[str] = field(default_factory=list)
    # plain values that split blocks of one stack and one tensor layout (Swin's window shift): path -> the values
    splits: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def groups(self) -> Dict[str, List[str]]:
        groups: Dict[str, List[str]] = {}
        for name, key in self.keys.items():
            groups.setdefault(key, []).append(name)
        return groups

    @property
    def reuse(self) -> float:
        """Blocks per compiled graph."""
        return len(self.keys) / max(len(self.groups), 1)


def group_blocks(
    root: nn.Module,
    stacks: Sequence[Stack],
    notes: bool = True,
    prefix: str = "",
    above: Sequence[Tuple[str, nn.Module]] = (),
    trial: Optional[Trial] = None,
) -> BlockGroups:
    """Group the blocks of ``stacks`` (under ``root``, by qualified name) by ``structure_key``; with ``notes``,
    say what shares a graph and what splits one. ``root`` is named ``prefix`` in the model, under the modules
    ``above`` (``(name, module)``, outermost first), which may hold the decoder config that builds a KV cache.
    With ``trial``, a group whose blocks differ in floats or an index is traced once: a value the compiler
    specializes goes back into the key (an entry per value)."""
    result = BlockGroups()
    by_class: Dict[type, List[str]] = {}
    index_of: Dict[str, List[str]] = {}  # block -> its stack's index attributes
    splits_of: Dict[type, Dict[str, List[str]]] = {}
    for _, names in stacks:
        classes: Dict[type, List[str]] = {}
        for name in names:
            classes.setdefault(type(root.get_submodule(name)), []).append(name)
        for cls, same in classes.items():
            indices = index_attributes([root.get_submodule(name) for name in same])
            index_of.update({name: indices for name in same})
            by_class.setdefault(cls, []).extend(same)
            _add_splits(splits_of.setdefault(cls, {}), [root.get_submodule(name) for name in same], indices)
    for cls, names in by_class.items():
        blocks = {name: root.get_submodule(name) for name in names}
        for name, block in blocks.items():
            result.keys[name] = structure_key(block, index_of[name])
        # block -> (the module deciding use_cache, the decoder whose config builds a KV cache) for indexed blocks
        caches = {name: cache_builder(root, name, prefix, above) for name in names if index_of[name]}
        caches = {name: builder for name, builder in caches.items() if builder is not None}
        tried, specialized = [], []
        if trial is not None:
            tried, specialized = _tried(trial, blocks, result.keys, index_of, prefix, set(caches))
        # blocks whose index the trial found specialized are no longer indexed: no cache note, no builder
        builders = dict(caches[name] for name in names if index_of[name] and name in caches)
        result.cache_builders.update(builders)
        for name in names:
            result.indices.setdefault(result.keys[name], index_of[name])
        for key, members in _members(result.keys, names).items():
            floats = _differing_floats([blocks[name] for name in members])
            if floats:
                result.shared_floats[key] = floats
        if notes:
            result.notes += tried + _notes(cls, names, blocks, result, index_of, splits_of[cls], prefix)
            result.specialized_notes += specialized
            result.cache_notes += _cache_notes(cls, names, index_of, builders)
    for splits in splits_of.values():
        for path, values in splits.items():
            result.splits[path] = sorted({*values, *result.splits.get(path, ())})
    return result


def _tried(
    trial: Trial,
    blocks: Dict[str, nn.Module],
    keys: Dict[str, str],
    index_of: Dict[str, List[str]],
    prefix: str,
    cache_addressed: Set[str],
) -> Tuple[List[str], List[str]]:
    """Trace one block of each group whose blocks differ in floats or an index; where the compiler specializes one
    of them, give each value a key of its own (in ``keys``) and take it out of ``index_of``. Returns the notes (none
    for a trace that failed where the blocks differ only in the index of a KV cache, ``cache_addressed``: the cache
    note explains it) and, for the values specialized, why the blocks differ without the entries it makes."""
    notes, specialized = [], []
    for key, members in _members(keys, list(blocks)).items():
        floats, indices = _differing_floats([blocks[name] for name in members]), index_of[members[0]]
        if len(members) < 2 or not (floats or indices):
            continue
        cls = f"{type(blocks[members[0]]).__name__} blocks{_which(members, list(blocks), prefix)}"
        pinned, failed = trial(blocks[members[0]], floats, indices)
        if failed is not None:
            if floats or not cache_addressed.issuperset(members):
                notes.append(
                    f"{len(members)} {cls} differ in {', '.join([*floats, *indices])}: whether the compiler "
                    f"specializes them shows at their first compile (no trial trace of one block before training: "
                    f"{failed}); if it does, the blocks move to an entry per value (a note says so)"
                )
            continue
        if not pinned:
            continue
        for name in members:
            values = plain_attributes(blocks[name])
            keys[name] = f"{key} specialized {sorted((path, values[path]) for path in pinned)!r}"
            index_of[name] = [path for path in index_of[name] if path not in pinned]
        path, guard = next(iter(pinned.items()))
        entries = len({keys[name] for name in members})
        why = (
            f"{len(members)} {cls} differ in {', '.join(pinned)}, which the compiler specializes (a trial trace "
            f"of one block before training guards on {path}: {guard})"
        )
        notes.append(f"{why}: {entries} compiled entries, one per value")
        specialized.append(why)
    return notes, specialized


def _members(keys: Dict[str, str], names: Sequence[str]) -> Dict[str, List[str]]:
    members: Dict[str, List[str]] = {}
    for name in names:
        members.setdefault(keys[name], []).append(name)
    return members


def _differing_floats(blocks: Sequence[nn.Module]) -> List[str]:
    per_block = [plain_attributes(block) for block in blocks]
    return sorted(
        path
        for path, value in per_block[0].items()
        if type(value) is float and len({repr(attrs[path]) for attrs in per_block}) > 1
    )


def cache_builder(
    root: nn.Module, block: str, prefix: str = "", above: Sequence[Tuple[str, nn.Module]] = ()
) -> Optional[Tuple[str, str]]:
    """(the module above ``block`` that decides ``use_cache`` for its forward, by qualified name; the decoder class
    whose config builds a KV cache) when the blocks run under a cache-building decoder config, else None."""
    parts = block.split(".")
    inside = [".".join(parts[:i]) for i in range(len(parts))]
    chain = [*above, *((join_name(prefix, name), root.get_submodule(name)) for name in inside)]
    decoder = kv_cache_config([module for _, module in chain])
    if decoder is None:
        return None
    for name, module in reversed(chain):
        if hasattr(getattr(module, "config", None), "use_cache") and _takes(module, "use_cache"):
            return name, decoder
    return None


def _takes(module: nn.Module, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_notes(cls, names, index_of, builders) -> List[str]:
    indices = sorted({path for name in names for path in index_of[name]})
    if not (indices and builders):
        return []
    decoders = ", ".join(sorted(set(builders.values())))
    modules = ", ".join(module or "<root>" for module in builders)
    return [
        f"{cls.__name__} blocks read their index ({', '.join(indices)}) only to address a KV cache, which "
        f"{decoders}'s config (use_cache=True) builds in training too: the training forwards of {modules} run "
        "without one (use_cache=False where the call does not ask for a cache), so the blocks share one graph; "
        "calls that pass a cache (evaluation, generation) run a graph per block"
    ]


def _notes(cls, names, blocks, groups: BlockGroups, index_of, splits: Dict[str, List[str]], prefix: str) -> List[str]:
    notes = []
    keys = {groups.keys[name] for name in names}
    indices = sorted({path for name in names for path in index_of[name]})
    for key, members in _members(groups.keys, names).items():
        if key not in groups.shared_floats:
            continue
        floats = ", ".join(groups.shared_floats[key])
        notes.append(
            f"{len(members)} {cls.__name__} blocks{_which(members, names, prefix)} differ only in the floats {floats}: "
            "one graph, each block's values passed to it as inputs (stochastic-depth probabilities as tensors, other "
            "floats as symbolic floats)"
        )
    difference = _difference([blocks[name] for name in names], indices)
    if len(keys) > 1 and difference:
        several_layouts = len({tensor_layout(blocks[name]) for name in names}) > 1  # else the values say it all
        within = ""
        if splits and several_layouts:
            within = f"; within a stack, blocks of one layout split by {describe_splits(splits)}"
        notes.append(
            f"{len(names)} {cls.__name__} blocks differ in structure ({difference}{within}): "
            f"{len(keys)} compiled entries, one per distinct structure"
        )
    return notes


def listed(names: Sequence[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def join_name(prefix: str, name: str) -> str:
    """``name`` qualified by ``prefix`` (modules' dotted names; either empty for the root)."""
    return ".".join(part for part in (prefix, name) if part)


def _which(members: Sequence[str], of: Sequence[str], prefix: str) -> str:
    """`` (a, b and 2 more)`` where ``members`` are some of the blocks ``of`` one class: which group a note means."""
    return "" if len(members) == len(of) else f" ({listed([join_name(prefix, m) for m in members])})"


def _add_splits(splits: Dict[str, List[str]], blocks: Sequence[nn.Module], ignored: Sequence[str]) -> None:
    """Into ``splits``: the values that differ between ``blocks`` (of one stack and class) of one tensor layout."""
    by_layout: Dict[Any, List[Dict[str, Any]]] = {}
    for block in blocks:
        by_layout.setdefault(tensor_layout(block), []).append(plain_attributes(block))
    for per_block in by_layout.values():
        for path, values in _differing_values(per_block, ignored).items():
            splits[path] = sorted(values | set(splits.get(path, ())))


def _differing_values(per_block: Sequence[Dict[str, Any]], ignored: Sequence[str]) -> Dict[str, set]:
    """path -> the values seen (floats by ``_float_marker``), for the plain values held by every block that differ
    between them, ``ignored`` left out; in path order."""
    paths = sorted(set.intersection(*(set(attrs) for attrs in per_block)) - set(ignored))
    values = {path: {_shown(attrs[path]) for attrs in per_block} for path in paths}
    return {path: seen for path, seen in values.items() if len(seen) > 1}


def describe_splits(splits: Dict[str, List[str]], shown: int = 3) -> str:
    """``shift_size (0, 2)``: what splits blocks of one stack and layout, for a plan note."""
    described = [f"{path} ({', '.join(values)})" for path, values in sorted(splits.items())]
    return ", ".join(described[:shown]) + (" ..." if len(described) > shown else "")


def _shown(value: Any) -> str:
    return _float_marker(value) if type(value) is float else repr(value)


def _difference(blocks: Sequence[nn.Module], ignored: Sequence[str]) -> str:
    """A short account of what splits blocks of one class (floats that differ but stay shared are left out)."""
    layouts = {tensor_layout(block) for block in blocks}
    reasons = ["parameter or submodule layout"] if len(layouts) > 1 else []
    differing = list(_differing_values([plain_attributes(block) for block in blocks], ignored))
    if differing:
        reasons.append("values " + ", ".join(differing[:4]) + (" ..." if len(differing) > 4 else ""))
    return "; ".join(reasons)
