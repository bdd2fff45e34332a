"""Which repeated blocks can share one compiled graph: grouped by structure, not by class alone.

Dynamo compiles a block's code once per set of guards. With parameters as graph inputs (the default since
torch 2.5), blocks of one class share a graph when their parameter and buffer shapes, their submodule layout
and the plain Python values their ``forward`` reads (an int used in control flow, a stride, a dropout rate)
are equal; a block that differs in any of them would recompile the shared entry, once per variant, until
``recompile_limit`` leaves the rest running eagerly (timm's ResNet: one downsampling block per stage, four
widths). ``structure_key`` captures all three, so blocks that differ get entries of their own.

One kind of value is left out: a per-block index (``layer_idx``), distinct in every block of a stack. Read in
``forward``, it makes every block its own graph; unread, it must not split the stack. Hugging Face decoder
layers read it exactly when a KV cache is built (``config.use_cache``, on by default, also in training), so an
index splits the blocks only under such a config, and the plan says how to share them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

PLAIN = (bool, int, float, str, type(None))
INDEX_NAMES = ("idx", "index", "layer_id", "block_id", "layer_number")
DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


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


@dataclass
class BlockGroups:
    """The blocks of one regional rule, grouped into sets that share one compiled graph."""

    keys: Dict[str, str] = field(default_factory=dict)  # block name -> structure key
    notes: List[str] = field(default_factory=list)

    @property
    def groups(self) -> Dict[str, List[str]]:
        groups: Dict[str, List[str]] = {}
        for name, key in self.keys.items():
            groups.setdefault(key, []).append(name)
        return groups


def structure_key(block: nn.Module, ignored: Sequence[str]) -> str:
    attributes = tuple(sorted((k, repr(v)) for k, v in plain_attributes(block).items() if k not in ignored))
    return repr((type(block).__qualname__, tensor_layout(block), attributes))


def group_blocks(root: nn.Module, block_names: Sequence[str]) -> BlockGroups:
    """Group ``block_names`` (blocks under ``root``, by qualified name) by ``structure_key``."""
    result = BlockGroups()
    by_class: Dict[type, List[str]] = {}
    for name in block_names:
        by_class.setdefault(type(root.get_submodule(name)), []).append(name)
    for cls, names in by_class.items():
        blocks = [root.get_submodule(name) for name in names]
        indices = index_attributes(blocks)
        cache_owner = kv_cache_config(_ancestors(root, names[0]))
        ignored = [] if cache_owner else indices
        for name, block in zip(names, blocks):
            result.keys[name] = structure_key(block, ignored)
        if indices and cache_owner:
            result.notes.append(
                f"{cls.__name__} blocks read their index ({', '.join(indices)}) while {cache_owner}'s config has "
                "use_cache=True (a KV cache is built in training too): each block gets a graph of its own. "
                "Set model.config.use_cache = False (or pass use_cache=False) to share one graph"
            )
        variants = len({result.keys[name] for name in names})
        difference = _difference(blocks, indices)  # an index that splits them was named above
        if variants > 1 and difference:
            result.notes.append(
                f"{len(names)} {cls.__name__} blocks differ in structure ({difference}): "
                f"{variants} compiled entries, one per distinct structure"
            )
    return result


def _ancestors(root: nn.Module, name: str) -> List[nn.Module]:
    parts = name.split(".")
    return [root] + [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


def _difference(blocks: Sequence[nn.Module], ignored: Sequence[str]) -> str:
    """A short account of what differs between blocks of one class."""
    layouts = {tensor_layout(block) for block in blocks}
    reasons = ["parameter or submodule layout"] if len(layouts) > 1 else []
    per_block = [plain_attributes(block) for block in blocks]
    paths = sorted({path for attrs in per_block for path in attrs} - set(ignored))
    differing = [path for path in paths if len({repr(attrs.get(path)) for attrs in per_block}) > 1]
    if differing:
        reasons.append("values " + ", ".join(differing[:4]) + (" ..." if len(differing) > 4 else ""))
    return "; ".join(reasons)
