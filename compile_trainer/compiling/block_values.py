"""Per-block values that need not split the blocks sharing one compiled entry (``planning.structure``).

- **Floats that differ between the blocks** (stochastic-depth probabilities, per-layer scales): the shared entry
  is primed so that Dynamo takes them as symbolic graph inputs from its first compile (``compat``), and each
  block's call passes its own values.
- **A per-block index read only to address a KV cache** (Hugging Face's ``layer_idx``): the decoder that builds
  the cache in training (``config.use_cache``, on by default) runs its training forwards without one
  (``use_cache=False`` unless the call passes ``use_cache``; ``train_without_cache``), as it does under gradient
  checkpointing; calls that pass a cache (evaluation, generation: unchanged) run an entry of the block's own
  (``passes_kv_cache``), one graph per block.

Stochastic depth (timm's ``DropPath``, transformers' ``*DropPath``, torchvision's ``StochasticDepth``) runs, while
compiled, a forward that reads its probability from a tensor (``share_stochastic_depth``): timm's own hands the
float to ``bernoulli_``, and torch before 2.13 specializes any float attribute of a module. Where the compiler
specializes such a value anyway (an attention's scale goes to ``scaled_dot_product_attention``, GPT-2 of
transformers 4.x divides by ``layer_idx + 1``: Dynamo bakes an int attribute of a module into the graph), the
graph guards on it. ``trial_trace`` finds that before training (one symbolic trace of one block, run by no
compiler), so that the plan gives each value an entry of its own before it is printed. Where no trial could be
made (a block that takes more than one tensor), the first compile shows it: ``SharedValues`` then moves the
other blocks to entries per value before they run, so the shared entry never recompiles; the plan's notes say so.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling import region_call

ENTRY_ARGUMENT = "module"  # the name of the module argument of every region's entry function
CONSTANT_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
NUMBERS = (int, float)
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


# Stochastic depth, whose probability the compiler specializes (timm's ``drop_path`` hands it to ``bernoulli_``;
# before torch 2.13 any float attribute of a module): class name -> the attribute holding the probability.
STOCHASTIC_DEPTH = {"DropPath": "drop_prob", "StochasticDepth": "p"}


def _stochastic_depth(module: nn.Module) -> Optional[str]:
    """The probability's attribute of timm's ``DropPath``, transformers' ``*DropPath`` and torchvision's
    ``StochasticDepth``; None for any other module."""
    name = type(module).__name__
    attribute = STOCHASTIC_DEPTH.get(name) or (STOCHASTIC_DEPTH["DropPath"] if name.endswith("DropPath") else None)
    return attribute if attribute is not None and hasattr(module, attribute) else None


KEEP_BUFFER = "_compile_trainer_keep_probability"  # non-persistent: state_dict keys are unchanged


def _stochastic_depth_compiled(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A stochastic-depth module's forward while compiled: each sample (or, in torchvision's ``batch`` mode, the
    whole batch) kept with probability ``keep = 1 - p`` and scaled by ``1 / keep``, as the module's own forward
    does, with ``keep`` read from a tensor buffer: a graph input, so blocks of different ``p`` share one graph
    (Dynamo specializes a float attribute of a module before torch 2.13, however primed). One function for
    every module (Dynamo guards on the function). Outside a compile, the module's own forward runs."""
    if not torch.compiler.is_compiling():
        return type(self).forward(self, x)
    if not self.training:
        return x
    keep = getattr(self, KEEP_BUFFER)
    shape = (1,) * x.dim() if getattr(self, "mode", "row") == "batch" else (x.shape[0],) + (1,) * (x.dim() - 1)
    kept = (keep + torch.rand(shape, dtype=keep.dtype, device=x.device)).floor()
    if getattr(self, "scale_by_keep", True):
        kept = torch.where(keep > 0, kept / keep, kept)  # p = 1 drops every sample, as timm's does
    return x * kept.to(x.dtype)


class StochasticDepthBuffers:
    """The stochastic-depth modules of one block that read their probability from a tensor buffer while compiled
    (``share_stochastic_depth``). ``sync`` refills a buffer whose module's probability changed since (a drop-path
    schedule): the compiled code reads only the buffer. It runs before each call of the block's region
    (``SyncStochasticDepth``), outside the compiled code."""

    def __init__(self, owners: List[Tuple[nn.Module, str]]):
        self.owners = owners
        self.values = [getattr(owner, attribute) for owner, attribute in owners]

    def sync(self) -> None:
        for index, (owner, attribute) in enumerate(self.owners):
            value = getattr(owner, attribute)
            if value != self.values[index]:
                if not 0 <= value <= 1:
                    raise ValueError(f"{type(owner).__name__}.{attribute} = {value}: a probability in [0, 1]")
                getattr(owner, KEEP_BUFFER).fill_(1.0 - value)
                self.values[index] = value

    def undo(self) -> None:
        for owner, _ in self.owners:
            vars(owner).pop("forward", None)
            owner._buffers.pop(KEEP_BUFFER, None)


def _shareable_probability(block: nn.Module, path: str) -> Optional[Tuple[nn.Module, str]]:
    """(the stochastic-depth module, its probability's attribute) where ``path`` in ``block`` names a probability
    that ``share_stochastic_depth`` can read from a tensor; None otherwise."""
    owner_path, _, attribute = path.rpartition(".")
    owner = block.get_submodule(owner_path) if owner_path else block
    if _stochastic_depth(owner) != attribute or not 0 <= getattr(owner, attribute) < 1:
        return None
    return owner, attribute


def share_stochastic_depth(block: nn.Module, floats: Sequence[str]) -> StochasticDepthBuffers:
    """Make the stochastic-depth modules of ``block`` that own one of ``floats`` take their probability from a
    tensor when compiled (``_stochastic_depth_compiled``; eager calls unchanged)."""
    device = next((p.device for p in block.parameters()), None)
    owners = []
    for path in floats:
        shareable = _shareable_probability(block, path)
        if shareable is None or "forward" in vars(shareable[0]):
            continue
        owner, attribute = shareable
        owner.register_buffer(KEEP_BUFFER, torch.tensor(1.0 - getattr(owner, attribute), device=device), False)
        owner.forward = types.MethodType(_stochastic_depth_compiled, owner)
        owners.append((owner, attribute))
    return StochasticDepthBuffers(owners)


class SyncStochasticDepth:
    """Interceptor (``region_call.SYNC_VALUES``): before a region's call, its stochastic-depth buffers take the
    probabilities their modules hold now."""

    position = region_call.SYNC_VALUES
    replaces_compiled = False

    def __init__(self) -> None:
        self.buffers: Dict[int, StochasticDepthBuffers] = {}  # id of the region's CompiledRegion -> its buffers

    def __call__(self, item: Any, proceed: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        buffers = self.buffers.get(id(item))
        if buffers is not None:
            buffers.sync()
        return proceed(*args, **kwargs)


class SharedValues:
    """The per-block values of one compiled entry's blocks: primes the entry and watches its compiles.

    ``floats`` (paths in the block) differ between the blocks and are primed as symbolic graph inputs; ``indices``
    were left out of the structure key (read, as far as the plan knows, only to address a KV cache). Dynamo
    specializes an int attribute of a module whatever the priming, so an index read in the traced computation is
    always pinned. ``guard_filter`` is given to ``torch.compile`` for each block (it keeps every guard). At the first
    compile that guards on one of the values, ``on_specialized(values, reason)`` is called once with the values
    the compiled graph holds (path -> value, those it could read) and the guard that pins them.
    """

    def __init__(
        self, floats: Sequence[str], indices: Sequence[str], on_specialized: Callable[[Dict[str, Any], str], None]
    ):
        self.floats = list(floats)
        self.paths = [*self.floats, *indices]
        self.sources = {path: compat.float_source(ENTRY_ARGUMENT, path) for path in self.paths}
        # a guard's own name leaves out the frame's locals marker: match on what follows the argument
        self.suffixes = {path: source.split("]", 1)[1] for path, source in self.sources.items()}
        self.on_specialized = on_specialized
        self.specialized: Optional[str] = None  # the guard that pinned a value, once seen

    def prime(self, code: Any) -> None:
        compat.prime_dynamic_floats(code, [self.sources[path] for path in self.floats])

    def guard_filter(self, guards: Sequence[Any]) -> List[bool]:
        if self.specialized is None:
            pinned = self.pinned(guards)
            if pinned:
                self.specialized = next(iter(pinned.values()))
                self.on_specialized(self._values(guards), self.specialized)
        return [True] * len(guards)

    def pinned(self, guards: Sequence[Any]) -> Dict[str, str]:
        """The paths whose value ``guards`` pin -> the guard that does."""
        found: Dict[str, str] = {}
        for guard in guards:
            if guard.guard_type in CONSTANT_GUARDS:
                for path in self._mentioned(guard.name):
                    found.setdefault(path, f"{guard.guard_type} on {guard.name}")
            for part in compat.guard_code_parts(guard) if guard.guard_type == "SHAPE_ENV" else []:
                if EQUALITY.search(part):
                    for path in self._mentioned(part):
                        found.setdefault(path, part)
        return found

    def _mentioned(self, text: str) -> List[str]:
        return [path for path, suffix in self.suffixes.items() if re.search(re.escape(suffix) + r"(?![\w\[.])", text)]

    def _values(self, guards: Sequence[Any]) -> Dict[str, Any]:
        values = {}
        for path, suffix in self.suffixes.items():
            held = [g.value for g in guards if g.has_value and g.name.endswith(suffix) and type(g.value) in NUMBERS]
            if held:
                values[path] = held[0]
        return values


def block_values(block: nn.Module, paths: Sequence[str]) -> Dict[str, Any]:
    """The values of ``paths`` (``"drop_path.drop_prob"``, ``"attn.layer_idx"``) in ``block``."""
    values = {}
    for path in paths:
        owner, _, attribute = path.rpartition(".")
        values[path] = getattr(block.get_submodule(owner) if owner else block, attribute)
    return values


TRIAL_PREFIX = "block_trial__"  # the code name of a trial trace's frame (not a region's entry)


class _Traced(Exception):
    """Raised where a trial trace's graph would run."""


def _trace_only(graph: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
    def not_run(*args: Any) -> Any:
        raise _Traced

    return not_run


def _trial_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:  # ``module``: ENTRY_ARGUMENT, as in an entry
    return compat.call_uncompiled(module, *args, **kwargs)


def example_input(block: nn.Module) -> Optional[torch.Tensor]:
    """An input of the shape the block's first layer with weights takes (zeros: no random numbers drawn), or None
    where that layer gives no shape: a token sequence ``(2, 4, features)`` for a norm or a linear layer, an image
    ``(2, channels, 8, 8)`` for a 2-d convolution."""
    with_weights = [m for m in block.modules() if any(True for _ in m.parameters(recurse=False))]
    shaped = (nn.Conv2d, nn.Linear, nn.LayerNorm)  # a block's own 1-d parameters (a layer scale) say less
    first = next((m for m in with_weights if isinstance(m, shaped)), with_weights[0] if with_weights else None)
    if first is None:
        return None
    weight = next(first.parameters(recurse=False))
    like = {"dtype": weight.dtype, "device": weight.device}
    if isinstance(first, nn.Conv2d):
        return torch.zeros(2, first.in_channels, 8, 8, **like)
    if isinstance(first, nn.Linear):
        features = first.in_features
    elif isinstance(first, nn.LayerNorm) and len(first.normalized_shape) == 1:
        features = first.normalized_shape[0]
    elif all(p.dim() == 1 for p in first.parameters(recurse=False)):  # an RMS norm's scale, a bias-only layer
        features = weight.shape[0]
    else:
        return None
    return torch.zeros(2, 4, features, **like)


def trial_trace(
    block: nn.Module, floats: Sequence[str], indices: Sequence[str]
) -> Tuple[Dict[str, str], Optional[str]]:
    """Which per-block values the compiler specializes, seen before training: Dynamo traces ``block`` once in
    training mode (gradients on, ``floats`` primed as symbolic as in its entry) on ``example_input``; the graph is
    handed to no compiler and never run. Returns (path -> the guard that pins its value, None), or ({}, why no trace
    was made): the first real compile then shows it (``SharedValues``). Stochastic-depth probabilities alone need
    no trace: compiled, they are read from a tensor (``share_stochastic_depth``)."""
    if not indices and all(_shareable_probability(block, path) is not None for path in floats):
        return {}, None
    example = example_input(block)
    if example is None:
        return {}, "no input shape known from its first layer"
    name = f"{TRIAL_PREFIX}{type(block).__name__}"
    trial = compat.renamed_function(_trial_call, name)
    code = trial.__code__
    values = SharedValues(floats, indices, lambda *_: None)
    values.prime(code)
    found: Dict[str, str] = {}

    def watch(guards: Sequence[Any]) -> List[bool]:
        found.update(values.pinned(guards))
        return [True] * len(guards)

    compiled = torch.compile(
        types.MethodType(trial, block), backend=_trace_only, fullgraph=True, options={"guard_filter_fn": watch}
    )
    modes = [(module, module.training) for module in block.modules()]
    block.train()
    shared = share_stochastic_depth(block, floats)
    try:
        with torch.enable_grad(), contextlib.suppress(_Traced):
            compiled(example)
    except Exception as error:  # a block that needs more than one tensor (a mask, position embeddings)
        return {}, f"called with one tensor of shape {tuple(example.shape)}: {compat.traced_error_summary(error)}"
    finally:
        shared.undo()
        for module, training in modes:
            module.training = training
    return found, None
