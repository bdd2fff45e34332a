"""Applying a plan: compile regions in place, keep eager modules eager, report what happened.

Regions are compiled in place (the module's compiled call, as ``nn.Module.compile`` sets it), so
``state_dict()`` keys never gain ``_orig_mod.``. Each region's top frame is a small entry function
whose code object is made per ``EntryKey`` (class, settings, block structure): blocks of one structure
(``planning.structure``) share one cache entry, and therefore one compiled graph, while other regions
never collide in it. This also works for classes defined in ``torch.nn``, which ``module.compile()`` silently
skips on torch < 2.14 (their ``forward`` lives in files Dynamo does not trace as a top frame).

What a region's call does besides running the compiled code is the business of its interceptors
(``compile_trainer.compiling.region_call``); process-wide settings the policy changes
(``compiling.process_settings``) are restored by ``AppliedPolicy.remove()``. The plan table is
``compiling.plan_table``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling.arguments import kwargs_use_cuda_graphs, regions_compile_kwargs
from compile_trainer.compiling.backends import RegionBackend
from compile_trainer.compiling.block_values import (
    SharedValues,
    SyncStochasticDepth,
    block_values,
    passes_kv_cache,
    share_stochastic_depth,
    train_without_cache,
)
from compile_trainer.compiling.nested import check_nested, mark_nested_blocks
from compile_trainer.compiling.process_settings import hold_process_settings, trial_trace_dropping_once_warnings
from compile_trainer.compiling.promoted_inputs import PromotedInputs
from compile_trainer.compiling.region_call import InterceptorChain, RegionCall
from compile_trainer.compiling.runtime_checks import background_compile_problem, check_policy_runtime
from compile_trainer.compiling.thread_guards import blind_to_guarded_tracing
from compile_trainer.compiling.warmup import start_compiler_warmup
from compile_trainer.planning.plan import CompilePlan, Region
from compile_trainer.planning.selection import resolve_plan
from compile_trainer.schema import CompilePolicy, PolicyError

APPLIED_ATTR = "_compile_trainer_applied"
ENTRY_PREFIX = "compiled_region__"


@dataclass(frozen=True)
class EntryKey:
    """What a compiled entry is for: regions of equal keys call one entry function, so one cache entry and one
    compiled graph. Blocks of one structure share a key; any other region has one of its own, so that differently
    shaped modules of one class (two embeddings, say) never recompile each other."""

    cls: type
    settings: str  # the region's torch.compile arguments, sorted (``repr``)
    scope: str  # a block's structure (``planning.structure``), or ``@`` and the region's name
    values: str = ""  # where blocks moved to an entry per value (``_split_by_value``): their values (``repr``)
    cache_of: str = ""  # the block whose own entry runs its calls that pass a KV cache (``CompiledRegion.route``)

    @classmethod
    def of(cls, region: Region, kwargs: Dict[str, Any]) -> EntryKey:
        """The key of ``region`` compiled with ``kwargs``."""
        scope = region.structure if region.role == "block" else f"@{region.name}"
        return cls(type(region.module), repr(sorted(kwargs.items())), scope)

    @functools.cached_property
    def text(self) -> str:
        """The key as text, the same in any process (``cache.precompiled`` names an artifact's entry by it)."""
        text = f"{self.cls.__module__}.{self.cls.__qualname__}:{self.settings}{self.scope}"
        text += f"|{self.values}" if self.values else ""
        return text + (f"@{self.cache_of}+cache" if self.cache_of else "")


@dataclass
class CompiledRegion:
    """A region as compiled: the arguments given to ``torch.compile`` and how often it ran."""

    region: Region
    entry: types.FunctionType  # the top frame Dynamo compiles; its code name is what Dynamo reports
    key: EntryKey
    compile_kwargs: Dict[str, Any]
    calls: int = 0
    # Watches the entry's compiles where its blocks differ in per-block values (``block_values.SharedValues``).
    guard_filter: Optional[Callable[[Sequence[Any]], List[bool]]] = None
    # The entry of this block's own that calls passing a KV cache run (``region.indices``), once one came.
    cache_entry: Optional[types.FunctionType] = None
    cache_call: Optional[Callable[..., Any]] = None

    @property
    def entry_name(self) -> str:
        return self.entry.__name__

    @property
    def entry_key(self) -> str:
        """What the entry is for (``EntryKey.text``): its region's class, compile settings and block structure."""
        return self.key.text

    def compile_on(self, module: nn.Module, entry: Optional[types.FunctionType] = None) -> Callable[..., Any]:
        """``torch.compile`` of the entry (or ``entry``) bound to ``module``: every module given here shares one
        cache entry. The backend is a ``RegionBackend`` (graphs that a background thread compiles without running
        them, and whose calls the telemetry's FLOPs count observes) of the settings' backend, mode and options."""
        kwargs = dict(self.compile_kwargs)
        backend = kwargs.pop("backend"), kwargs.pop("mode"), kwargs.pop("options"), kwargs["dynamic"]
        kwargs["backend"] = RegionBackend(*backend)
        if self.guard_filter is not None and entry is None:  # torch.compile takes it out of the options
            kwargs["options"] = {"guard_filter_fn": self.guard_filter}
        with blind_to_guarded_tracing():  # blocks run compiled while a thread compiles the rest (rest: background)
            return torch.compile(types.MethodType(entry or self.entry, module), **kwargs)

    def route(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Callable[..., Any]]:
        """What a call runs instead of the shared entry: for a call passing a KV cache to a block whose index
        addresses it, an entry of the block's own (compiled at the first such call). None: the shared entry."""
        if not passes_kv_cache(args, kwargs):
            return None
        if self.cache_call is None:
            self.cache_entry = _entry_function(dataclasses.replace(self.key, cache_of=self.region.name))
            self.cache_call = self.compile_on(self.region.module, self.cache_entry)
        return self.cache_call


@dataclass
class AppliedPolicy:
    """What ``apply_policy`` did to a model; ``remove()`` undoes it."""

    policy: CompilePolicy
    plan: CompilePlan
    root: nn.Module
    compiled: List[CompiledRegion] = field(default_factory=list)
    eager_inside: List[str] = field(default_factory=list)
    # block class -> its own ``forward`` before it was marked as a nested compile region (None: inherited)
    nested_classes: Dict[type, Optional[Callable[..., Any]]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    # What every region's call runs before (or instead of) its compiled code.
    interceptors: InterceptorChain = field(default_factory=InterceptorChain)
    # Process-wide settings held while the policy is applied; closed by remove().
    process_settings: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    # Why a background policy compiles in the foreground instead (compile_in_foreground), or None.
    foreground_reason: Optional[str] = None
    # Who applied it (apply_policy, or a CompileCallback that called it), named when another policy meets it.
    applied_by: str = "apply_policy"

    @property
    def uses_cuda_graphs(self) -> bool:
        return any(kwargs_use_cuda_graphs(item.compile_kwargs) for item in self.compiled)

    @property
    def uses_inductor(self) -> bool:
        return any(item.compile_kwargs["backend"] == "inductor" for item in self.compiled)

    @property
    def background_lowering(self) -> str:
        """Where a background compile lowers its graphs: the policy's (``CompilePolicy.lowering``); ``thread`` where
        no region compiles with Inductor (only Inductor lowers graphs)."""
        return self.policy.lowering if self.uses_inductor else "thread"

    def begin_step(self) -> None:
        """Call before each training or evaluation step (``CompileCallback`` does).

        With CUDA graphs, a step's outputs live in a memory pool that the next step's replays overwrite;
        PyTorch starts a new step when a compiled function is called again, which is wrong as soon as one
        step calls several regions (the second block would overwrite the first block's saved outputs).
        Marking the step makes the boundary explicit. Does nothing without CUDA graphs, or while an
        interceptor runs the regions eagerly instead (a background compile).
        """
        if self.uses_cuda_graphs and not self.interceptors.replaces_compiled:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def background_parts(self) -> List[CompiledRegion]:
        """The regions that compile on a background thread after the first step: a regional rule's rest
        (``rest: background``; ``rest: auto``'s parts inside an outer region's breaks) and, under ``rest: auto``,
        blocks whose structure no other block shares."""
        return [item for item in self.compiled if item.region.background]

    @property
    def defers_compiles(self) -> bool:
        """Whether regions wait for a background compile (``compiling.background``): every region
        (``background: true``), or ``background_parts``."""
        return self.policy.enabled and (self.policy.background or bool(self.background_parts))

    def compile_in_foreground(self, reason: str) -> None:
        """A background policy's regions compile at their first call, as without ``background``; the plan
        table says so, with ``reason``."""
        self.foreground_reason = reason

    def shared_counts(self) -> Dict[str, int]:
        """How many regions share each compiled entry (and so one compiled graph)."""
        counts: Dict[str, int] = {}
        for item in self.compiled:
            counts[item.entry_name] = counts.get(item.entry_name, 0) + 1
        return counts

    def remove(self) -> None:
        """Restore every module to plain eager execution, and the process-wide settings the policy changed."""
        for item in self.compiled:
            compat.install_compiled_call(item.region.module, None)
        self.interceptors = InterceptorChain()
        for cls, forward in self.nested_classes.items():
            if forward is None:
                delattr(cls, "forward")
            else:
                cls.forward = forward
        for name in self.eager_inside:
            self.root.get_submodule(name).__dict__.pop("forward", None)
        self.root.__dict__.pop(APPLIED_ATTR, None)
        self.process_settings.close()


def _call_region(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return compat.call_uncompiled(module, *args, **kwargs)


_entries: Dict[EntryKey, types.FunctionType] = {}


def _entry_function(key: EntryKey) -> types.FunctionType:
    """A copy of ``_call_region`` per key: regions of one key share a cache entry, and one graph."""
    if key not in _entries:
        same_class = sum(1 for other in _entries if other.cls is key.cls)
        name = f"{ENTRY_PREFIX}{key.cls.__name__}" + (f"_{same_class}" if same_class else "")
        _entries[key] = compat.renamed_function(_call_region, name)
    return _entries[key]


def _may_compile_rest_in_background(policy: CompilePolicy, device: torch.device) -> bool:
    """Whether ``rest: auto`` may resolve to ``background``: on a GPU (on a CPU the thread would take cores from
    training), where nothing else decides when compiles happen (a compile cache, bucket warm-up, ``background``)."""
    others = policy.background or policy.cache.active or policy.shapes.warmup
    return device.type == "cuda" and not others and background_compile_problem(policy.lowering) is None


def model_device(module: nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _refuse_user_compiled(root: nn.Module) -> None:
    """A module the user compiled already would keep its own compiled call and hide the policy's regions."""
    compiled = [
        (name or "<root>", how) for name, module in root.named_modules() if (how := compat.user_compiled(module))
    ]
    if compiled:
        listed = ", ".join(f"{name} ({how})" for name, how in compiled[:5])
        raise PolicyError(
            f"already compiled by your code: {listed}. A compile policy compiles the modules itself; remove the "
            "torch.compile / .compile() call (or accelerate's compile_regions) and let the policy say what to "
            "compile, or use the `none` policy to keep your own compile."
        )


def apply_policy(root: nn.Module, policy: CompilePolicy, device: Optional[torch.device] = None) -> AppliedPolicy:
    """Resolve ``policy`` against ``root`` and compile its regions in place.

    Compilation itself is lazy (at each region's first call); errors in the policy are raised here.
    """
    _refuse_applied_twice(root)
    check_policy_runtime(policy)
    start_compiler_warmup(policy)
    if policy.compiles_modules:
        _refuse_user_compiled(root)
    device = device or model_device(root)
    background_rest = _may_compile_rest_in_background(policy, device)
    plan = resolve_plan(root, policy, trial_trace_dropping_once_warnings, background_rest)
    applied = AppliedPolicy(policy=policy, plan=plan, root=root, notes=list(plan.notes))
    if policy.enabled:
        planned = _checked_compile_kwargs(applied, device)  # every check before anything is compiled
        applied.notes += hold_process_settings(policy, device, applied.process_settings)
        _install_regions(applied, planned)
        _keep_eager_modules_eager(applied)
    setattr(root, APPLIED_ATTR, applied)
    return applied


def _refuse_applied_twice(root: nn.Module) -> None:
    if getattr(root, APPLIED_ATTR, None) is not None:
        previous = getattr(root, APPLIED_ATTR).policy.name
        raise PolicyError(
            f"a compile policy ({previous!r}) is already applied to this {type(root).__name__}; "
            "apply one policy once per model (call .remove() on the first AppliedPolicy to undo it)."
        )


def _checked_compile_kwargs(applied: AppliedPolicy, device: torch.device) -> List[Tuple[Region, Dict[str, Any]]]:
    """Each region with its ``torch.compile`` arguments on ``device``, nested regions checked; the notes on what
    changed in the arguments join ``applied.notes``."""
    regions = applied.plan.regions
    kwargs, notes = regions_compile_kwargs(regions, applied.policy, device)
    for region, region_kwargs in zip(regions, kwargs):
        if region.role == "nested":
            check_nested(region, region_kwargs, device, applied.root)
    applied.notes += notes
    return list(zip(regions, kwargs))


def _install_regions(applied: AppliedPolicy, planned: List[Tuple[Region, Dict[str, Any]]]) -> None:
    """Give each region its compiled call (a ``RegionCall`` of the entry of its ``EntryKey``), with the
    interceptors its blocks' per-block values and input dtypes ask for."""
    shared_values: Dict[EntryKey, SharedValues] = {}  # entry key -> its blocks' per-block values
    stochastic_depth: Optional[SyncStochasticDepth] = None
    for region, kwargs in planned:
        key = EntryKey.of(region, kwargs)
        item = CompiledRegion(region, _entry_function(key), key, kwargs)
        if region.shared_floats or region.indices:
            item.guard_filter = _shared_values(applied, item, shared_values).guard_filter
            buffers = share_stochastic_depth(region.module, region.shared_floats)
            applied.process_settings.callback(buffers.undo)
            if buffers.owners:
                if stochastic_depth is None:
                    stochastic_depth = SyncStochasticDepth()
                    applied.interceptors.add(stochastic_depth)
                stochastic_depth.buffers[id(item)] = buffers
        route = item.route if region.indices else None
        call = RegionCall(item, item.compile_on(region.module), applied.interceptors, route=route)
        compat.install_compiled_call(region.module, call)
        applied.compiled.append(item)
        if region.role == "nested":
            mark_nested_blocks(applied.nested_classes, applied.root, region)
    blocks = Counter(item.key for item in applied.compiled if item.region.role == "block")
    if any(count > 1 for count in blocks.values()):
        shared = functools.partial(_blocks_share_entry, applied)
        applied.interceptors.add(PromotedInputs(shared, functools.partial(_note_upcast, applied)))


def _shared_values(
    applied: AppliedPolicy, item: CompiledRegion, shared_values: Dict[EntryKey, SharedValues]
) -> SharedValues:
    """The per-block values of the blocks of ``item``'s entry, made (and primed on the entry's code) for its first
    block; a value the compiler specializes moves blocks to entries per value (``_split_by_value``)."""
    values = shared_values.get(item.key)
    if values is None:
        region = item.region
        on_pinned = functools.partial(_split_by_value, applied, item.key)
        values = shared_values[item.key] = SharedValues(region.shared_floats, region.indices, on_pinned)
        values.prime(item.entry.__code__)
    return values


def _keep_eager_modules_eager(applied: AppliedPolicy) -> None:
    """Training forwards without a KV cache where the plan says so; the modules the plan keeps eager inside a
    compiled region become graph breaks."""
    plan, root = applied.plan, applied.root
    for name in plan.training_without_cache:
        applied.process_settings.callback(train_without_cache(root.get_submodule(name)).remove)
    for name in plan.eager:
        if plan.enclosing_region(name) is not None:
            module = root.get_submodule(name)
            module.forward = torch.compiler.disable(module.forward)
            applied.eager_inside.append(name)


def _blocks_share_entry(applied: AppliedPolicy, entry_key: str) -> bool:
    """Whether more than one block calls the entry ``entry_key`` now (entries split by value included)."""
    return sum(item.entry_key == entry_key and item.region.role == "block" for item in applied.compiled) > 1


def _note_upcast(applied: AppliedPolicy, name: str) -> None:
    applied.notes.append(
        f"{name} and the blocks sharing its graph: bfloat16/float16 inputs upcast to float32, which the block "
        "promotes them to anyway (its outputs checked equal): one graph instead of one per input dtype"
    )


def _split_by_value(applied: AppliedPolicy, key: EntryKey, compiled: Dict[str, Any], pinned: str) -> None:
    """The compiler specialized a value the blocks of ``key`` were to share (``pinned``; no trial trace showed it
    before training): the blocks whose values differ from those compiled (``compiled``) move to entries per value,
    before their first call."""
    moved = []
    for item in [item for item in applied.compiled if item.key == key]:
        values = block_values(item.region.module, [*item.region.shared_floats, *item.region.indices])
        if compiled and all(values.get(path) == value for path, value in compiled.items()):
            continue
        item.key = dataclasses.replace(key, values=repr(sorted(values.items())))
        item.entry = _entry_function(item.key)
        item.guard_filter = None
        compat.compiled_call(item.region.module).compiled = item.compile_on(item.region.module)
        moved.append(item.region.name)
    if moved:
        applied.notes.append(
            f"the compiler specialized a value the blocks were to share ({pinned}): {len(moved)} blocks "
            f"({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}) compile an entry per value instead"
        )
