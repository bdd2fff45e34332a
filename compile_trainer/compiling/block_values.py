"""Per-block values that need not split the blocks sharing one compiled entry (``planning.structure``).

- **Floats that differ between the blocks** (stochastic-depth probabilities, per-layer scales): the shared entry
  is primed so that Dynamo takes them as symbolic graph inputs from its first compile (``compat``), and each
  block's call passes its own values. Where the compiler specializes one anyway (timm's ``drop_path`` hands it to
  ``bernoulli_``, whose float argument is baked into the graph), the first compile shows it: a guard on the value.
  ``SharedFloats`` then moves the other blocks to entries per value before they run, so the shared entry never
  recompiles; the plan's notes say so.
- **A per-block index read only to address a KV cache** (Hugging Face's ``layer_idx``): the decoder that builds
  the cache in training (``config.use_cache``, on by default) runs its training forwards without one
  (``use_cache=False`` unless the call passes ``use_cache``; ``train_without_cache``), as it does under gradient
  checkpointing; calls that pass a cache (evaluation, generation: unchanged) run an entry of the block's own
  (``passes_kv_cache``), one graph per block.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from compile_trainer import compat

ENTRY_ARGUMENT = "module"  # the name of the module argument of every region's entry function
CONSTANT_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
EQUALITY = re.compile(r"(?<![!<>=])==(?!=)")


def passes_kv_cache(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """Whether a call passes a Hugging Face KV cache (any ``transformers.cache_utils.Cache``)."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cache is not None and any(isinstance(value, cache) for value in itertools.chain(args, kwargs.values()))


def train_without_cache(module: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make ``module``'s training forwards (training mode, gradients on) build no KV cache unless the call passes
    ``use_cache``; evaluation and generation are left as they are. Returns the hook's handle."""
    positional = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    position = positional.index("use_cache") if "use_cache" in positional else None

    def without_cache(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is not None:
            return None
        if position is not None and len(args) > position:
            return None
        return args, {**kwargs, "use_cache": False}

    return module.register_forward_pre_hook(without_cache, with_kwargs=True)


class SharedFloats:
    """The blocks of one compiled entry that differ in float attributes: primes the entry and watches its compiles.

    ``guard_filter`` is given to ``torch.compile`` for each block (it keeps every guard). At the first compile
    that guards on one of the floats' values, ``on_specialized(values, reason)`` is called once with the values
    the compiled graph holds (path -> value, those it could read) and the guard that pins them.
    """

    def __init__(self, paths: Sequence[str], on_specialized: Callable[[Dict[str, Any], str], None]):
        self.paths = list(paths)
        self.sources = {path: compat.float_source(ENTRY_ARGUMENT, path) for path in self.paths}
        # a guard's own name leaves out the frame's locals marker: match on what follows the argument
        self.suffixes = {path: source.split("]", 1)[1] for path, source in self.sources.items()}
        self.on_specialized = on_specialized
        self.specialized: Optional[str] = None  # the guard that pinned a value, once seen

    def prime(self, code: Any) -> None:
        compat.prime_dynamic_floats(code, list(self.sources.values()))

    def guard_filter(self, guards: Sequence[Any]) -> List[bool]:
        if self.specialized is None:
            reason = self._pinned(guards)
            if reason is not None:
                self.specialized = reason
                self.on_specialized(self._values(guards), reason)
        return [True] * len(guards)

    def _mentions(self, text: str) -> bool:
        return any(re.search(re.escape(suffix) + r"(?![\w\[.])", text) for suffix in self.suffixes.values())

    def _pinned(self, guards: Sequence[Any]) -> Optional[str]:
        for guard in guards:
            if guard.guard_type in CONSTANT_GUARDS and self._mentions(guard.name):
                return f"{guard.guard_type} on {guard.name}"
            for part in compat.guard_code_parts(guard) if guard.guard_type == "SHAPE_ENV" else []:
                if self._mentions(part) and EQUALITY.search(part):
                    return part
        return None

    def _values(self, guards: Sequence[Any]) -> Dict[str, Any]:
        values = {}
        for path, suffix in self.suffixes.items():
            held = [g.value for g in guards if g.has_value and g.name.endswith(suffix) and type(g.value) is float]
            if held:
                values[path] = held[0]
        return values


def float_values(block: nn.Module, paths: Sequence[str]) -> Dict[str, Any]:
    """The values of ``paths`` (``"drop_path.drop_prob"``) in ``block``."""
    values = {}
    for path in paths:
        owner, _, attribute = path.rpartition(".")
        values[path] = getattr(block.get_submodule(owner) if owner else block, attribute)
    return values
