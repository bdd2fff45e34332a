"""Applying a plan: compile regions in place, keep eager modules eager, report what happened.

Regions are compiled in place (the module's compiled call, as ``nn.Module.compile`` sets it), so
``state_dict()`` keys never gain ``_orig_mod.``. Each region's top frame is a small entry function
whose code object is made per (class, settings, block structure): blocks of one structure
(``planning.structure``) share one cache entry, and therefore one compiled graph, while other regions
never collide in it. This also
works for classes defined in ``torch.nn``, which ``module.compile()`` silently skips on
torch < 2.14 (their ``forward`` lives in files Dynamo does not trace as a top frame).

What a region's call does besides running the compiled code is the business of its interceptors
(``compile_trainer.compiling.region_call``); process-wide settings the policy changes (Dynamo's recompile
limit) are restored by ``AppliedPolicy.remove()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from compile_trainer import compat
from compile_trainer.compiling.backends import RegionBackend
from compile_trainer.compiling.block_values import (
    SharedValues,
    SyncStochasticDepth,
    block_values,
    passes_kv_cache,
    share_stochastic_depth,
    train_without_cache,
    trial_trace,
)
from compile_trainer.compiling.promoted_inputs import PromotedInputs
from compile_trainer.compiling.region_call import InterceptorChain, RegionCall
from compile_trainer.compiling.runtime_checks import background_compile_problem, check_policy_runtime
from compile_trainer.compiling.thread_guards import blind_to_guarded_tracing
from compile_trainer.compiling.warmup import start_compiler_warmup
from compile_trainer.planning.selection import CompilePlan, Region, resolve_plan
from compile_trainer.planning.structure import structure_key
from compile_trainer.schema import CompilePolicy, CompileSettings, PolicyError
from compile_trainer.tables import text_table

APPLIED_ATTR = "_compile_trainer_applied"
CPU_FALLBACK_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ENTRY_PREFIX = "compiled_region__"
NESTED_BACKENDS = ("aot_eager", "inductor")


@dataclass
class CompiledRegion:
    """A region as compiled: the arguments given to ``torch.compile`` and how often it ran."""

    region: Region
    entry: types.FunctionType  # the top frame Dynamo compiles; its code name is what Dynamo reports
    # What the entry is for: its region's class, compile settings and block structure (the same in any process).
    entry_key: str
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
            self.cache_entry = _entry_function(type(self.region.module), f"{self.entry_key}@{self.region.name}+cache")
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

    def rows(self) -> List[Dict[str, Any]]:
        """The plan as table rows: one per selected module."""
        shared = self.shared_counts()
        rows = []
        for item in self.compiled:
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
            blocks = [self.root.get_submodule(name) for name in region.nested_blocks]
            for name, block in zip(region.nested_blocks, blocks):
                same_class = sum(type(other) is type(block) for other in blocks)
                rows.append(_row(name, block, "nested block", region.rule_index, settings, same_class))
        for name, rule_index in self.plan.eager.items():
            action = "eager (graph break)" if name in self.eager_inside else "eager"
            rows.append(_row(name, self.root.get_submodule(name), action, rule_index, "-", 0))
        return rows

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


ROLE_ACTIONS = {
    "full": "full",
    "block": "regional block",
    "rest": "regional rest",
    "outer": "regional outer",
    "nested": "full, nested blocks",
}


def _row(name: str, module: nn.Module, action: str, rule: int, settings: str, shared_by: int) -> Dict[str, Any]:
    return {
        "module": name,
        "class": type(module).__name__,
        "action": action,
        "rule": rule,
        "settings": settings,
        "shares_graph_with": shared_by,
    }


def _describe_kwargs(kwargs: Dict[str, Any]) -> str:
    text = f"backend={kwargs['backend']} mode={kwargs['mode'] or 'default'}"
    if kwargs["fullgraph"]:
        text += " fullgraph"
    if kwargs["dynamic"] is not None:
        text += f" dynamic={kwargs['dynamic']}"
    if kwargs["options"]:
        text += f" options={kwargs['options']}"
    return text


def compile_kwargs(settings: CompileSettings, device: torch.device) -> Tuple[Dict[str, Any], List[str]]:
    """``torch.compile`` keyword arguments for ``settings`` on ``device``, with notes on what changed.

    ``mode`` and ``options`` only mean something to Inductor; both may be given (the mode's options
    are merged under the explicit ones). CUDA-graph and autotuning modes fall back to the default
    mode on the CPU, where they either do nothing or take many minutes.
    """
    notes: List[str] = []
    mode, options = settings.mode, dict(settings.options)
    if settings.backend != "inductor" and (mode or options):
        notes.append(f"mode/options ignored: backend {settings.backend!r} does not take them")
        mode, options = None, {}
    if device.type == "cpu" and mode in CPU_FALLBACK_MODES:
        notes.append(f"mode {mode!r} needs a GPU; using the default mode on the CPU")
        mode = None
    if mode == "default":
        mode = None
    if mode and options:
        options = {**compat.inductor_mode_options(mode), **options}
        mode = None
    kwargs = {
        "backend": settings.backend,
        "mode": mode,
        "fullgraph": settings.fullgraph,
        "dynamic": settings.dynamic,
        "options": options or None,
    }
    return kwargs, notes


def settings_for_varying_sizes(settings: CompileSettings, sizes_vary: bool) -> CompileSettings:
    """Where sizes vary between calls, Inductor options that keep Inductor from guarding on them
    (``compat.inductor_options_without_size_guards``); options the policy gives win. Sizes vary when they are
    declared dynamic (``shapes.dynamic``), and under compiler collectives (``distributed.consistent_dynamic_shapes``)
    whatever made them dynamic: there a guard on a size, checked against each rank's own sizes, recompiles one
    rank alone, which then waits in the compile's collective for ranks that never join it."""
    if not sizes_vary or settings.backend != "inductor":
        return settings
    options = {**compat.inductor_options_without_size_guards(), **settings.options}
    return dataclasses.replace(settings, options=options)


def kwargs_use_cuda_graphs(kwargs: Dict[str, Any]) -> bool:
    """Whether ``torch.compile(**kwargs)`` (``compile_kwargs``) asks Inductor for CUDA graphs, by its mode's
    options (``reduce-overhead``, ``max-autotune``) or its own."""
    mode_options = compat.inductor_mode_options(kwargs["mode"]) if kwargs["mode"] else {}
    return bool({**mode_options, **(kwargs["options"] or {})}.get("triton.cudagraphs"))


def _call_region(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return compat.call_uncompiled(module, *args, **kwargs)


_entries: Dict[Tuple[type, str], types.FunctionType] = {}  # (class, settings and region) -> entry


def _entry_function(cls: type, key_suffix: str) -> types.FunctionType:
    """A copy of ``_call_region`` per (class, key): regions of one key share a cache entry, and one graph."""
    key = (cls, key_suffix)
    if key not in _entries:
        same_class = sum(1 for c, _ in _entries if c is cls)
        name = f"{ENTRY_PREFIX}{cls.__name__}" + (f"_{same_class}" if same_class else "")
        _entries[key] = compat.renamed_function(_call_region, name)
    return _entries[key]


# From this torch on, a nested block called once may update buffers in training (2.9.1 refused it; 2.12 untried)
NESTED_SINGLE_CALL_MUTATION_VERSION = (2, 13)


def _check_nested(region: Region, kwargs: Dict[str, Any], device: torch.device, root: nn.Module) -> None:
    where = f"{region.name!r} (rule {region.rule_index}, rest: nested)"
    if kwargs["backend"] not in NESTED_BACKENDS:
        raise PolicyError(f"{where} needs an AOT backend ({', '.join(NESTED_BACKENDS)}), not {kwargs['backend']!r}.")
    if kwargs["backend"] == "inductor" and device.type == "cpu":
        raise PolicyError(
            f"{where}: Inductor on the CPU computed wrong gradients for nested compile regions (seen on torch 2.13); "
            "use rest: compile, or backend aot_eager on the CPU."
        )
    groups: Dict[str, List[str]] = {}  # structure -> the nested blocks that call one subgraph
    for name in region.nested_blocks:
        groups.setdefault(structure_key(root.get_submodule(name)), []).append(name)
    single_call_problem = compat.needs_torch(
        "a nested block called once that updates buffers in place in training", NESTED_SINGLE_CALL_MUTATION_VERSION
    )
    for names in (names for names in groups.values() if len(names) > 1 or single_call_problem):
        block = root.get_submodule(names[0])
        stats = next((name for name, m in block.named_modules() if _updates_running_stats(m)), None)
        if stats is not None:
            refused = (
                f"torch's invoke_subgraph refuses in-place buffer updates in a subgraph it calls more than once "
                f"(torch {torch.__version__})"
                if len(names) > 1
                else single_call_problem
            )
            raise PolicyError(
                f"{where}: the nested block(s) {', '.join(map(repr, names))} hold "
                f"{'.'.join(filter(None, (names[0], stats)))!r} ({type(block.get_submodule(stats)).__name__}), whose "
                f"forward updates its running statistics in place in training: {refused}. Use rest: compile (the "
                "'regional' policy), or norms without running statistics (track_running_stats=False)."
            )


def _updates_running_stats(module: nn.Module) -> bool:
    """A norm in training that updates running statistics (BatchNorm, SyncBatchNorm, and norms like them)."""
    return module.training and getattr(module, "track_running_stats", False) and hasattr(module, "running_mean")


def _mark_nested_blocks(applied: AppliedPolicy, root: nn.Module, region: Region) -> None:
    """Mark each block class's ``forward`` as a nested compile region (a no-op in eager execution).

    The mark must sit on the class's function: marking a per-instance bound method makes Dynamo reuse
    the first block's parameters for every block (wrong results, seen on torch 2.13).
    """
    for cls in {type(root.get_submodule(name)) for name in region.nested_blocks}:
        if cls in applied.nested_classes or compat.is_nested_compile_region(cls.forward):
            continue
        applied.nested_classes[cls] = cls.__dict__.get("forward")
        cls.forward = torch.compiler.nested_compile_region(cls.forward)


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


def once_logger_methods() -> set:
    """Hugging Face's ``logger.warning_once`` (added to ``logging.Logger`` by transformers): inside a
    compiled region each is a graph break (GPT-2's loss property calls one every step), so Dynamo is told to drop
    them while tracing. The message is still printed by any eager call."""
    # One method only: Dynamo sorts this set when it logs its config, and two lru_cache wrappers do not compare
    # (torch 2.11 logs "Unexpected exception logging compilation metrics" for every compile).
    return {logging.Logger.warning_once} if hasattr(logging.Logger, "warning_once") else set()


def _drop_once_logger_methods() -> set:
    """Tell Dynamo to drop ``once_logger_methods`` while tracing; returns the set to restore."""
    return compat.set_ignored_logger_methods(compat.ignored_logger_methods() | once_logger_methods())


def _trial_trace_dropping_once_warnings(block: nn.Module, floats: Sequence[str], indices: Sequence[str]) -> Any:
    """``trial_trace`` with ``once_logger_methods`` dropped as the compiled regions drop them: a block that calls
    one (HF's attention asked for weights it cannot give) is traced instead of failing the trial."""
    previous = _drop_once_logger_methods()
    try:
        return trial_trace(block, floats, indices)
    finally:
        compat.set_ignored_logger_methods(previous)


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


CUDNN_ATTENTION_OFF = (
    "shapes.dynamic without shapes.pad: cuDNN attention is off while the policy is applied "
    "(scaled_dot_product_attention uses flash or memory-efficient attention): cuDNN builds a plan for every new "
    "length, about 5.5 ms of host time per attention call (H100, torch 2.11), which made a 16-layer Llama's steps "
    "host-bound; with lengths padded to a few (shapes.pad) each plan is built once and cuDNN stays on"
)


COMPILER_COLLECTIVES_NOTE = (
    "compiler collectives on: every rank makes the same dynamic-shape decisions, Inductor guards on no size; seen "
    "to hang on 2 x H200 before that (torch 2.11, regional, ranks of different lengths), not re-measured since "
    "(docs/distributed.md)"
)


def apply_policy(root: nn.Module, policy: CompilePolicy, device: Optional[torch.device] = None) -> AppliedPolicy:
    """Resolve ``policy`` against ``root`` and compile its regions in place.

    Compilation itself is lazy (at each region's first call); errors in the policy are raised here.
    """
    if getattr(root, APPLIED_ATTR, None) is not None:
        previous = getattr(root, APPLIED_ATTR).policy.name
        raise PolicyError(
            f"a compile policy ({previous!r}) is already applied to this {type(root).__name__}; "
            "apply one policy once per model (call .remove() on the first AppliedPolicy to undo it)."
        )
    check_policy_runtime(policy)
    start_compiler_warmup(policy)
    if policy.compiles_modules:
        _refuse_user_compiled(root)
    device = device or model_device(root)
    background_rest = _may_compile_rest_in_background(policy, device)
    plan = resolve_plan(root, policy, _trial_trace_dropping_once_warnings, background_rest)
    applied = AppliedPolicy(policy=policy, plan=plan, root=root, notes=list(plan.notes))
    if not policy.enabled:
        setattr(root, APPLIED_ATTR, applied)
        return applied
    planned, noted = [], {}  # note -> the regions it applies to
    sizes_vary = bool(policy.shapes.dynamic) or policy.distributed.consistent_dynamic_shapes
    for region in plan.regions:  # every check before anything is compiled
        region.settings = settings_for_varying_sizes(region.settings, sizes_vary)
        kwargs, notes = compile_kwargs(region.settings, device)
        for note in notes:
            noted.setdefault(note, []).append(region.name)
        if region.role == "nested":
            _check_nested(region, kwargs, device, root)
        planned.append((region, kwargs))
    for note, names in noted.items():
        applied.notes.append(f"{'all regions' if len(names) == len(plan.regions) else ', '.join(names)}: {note}")
    # Restored by remove(), not by garbage collection: a generator-based context manager would restore them
    # whenever a forgotten AppliedPolicy is collected, under the feet of the policy applied since.
    applied.process_settings.callback(compat.set_recompile_limit, compat.set_recompile_limit(policy.recompile_limit))
    if not policy.distributed.split_graphs_at_ddp_buckets:
        applied.process_settings.callback(compat.set_optimize_ddp, compat.turn_off_ddp_optimizer())
    if policy.distributed.consistent_dynamic_shapes:
        applied.process_settings.callback(compat.set_compiler_collectives, compat.set_compiler_collectives(True))
        applied.notes.append(COMPILER_COLLECTIVES_NOTE)
    applied.process_settings.callback(compat.set_ignored_logger_methods, _drop_once_logger_methods())
    unpadded_lengths = policy.shapes.dynamic and not policy.shapes.pad.enabled
    if unpadded_lengths and device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        applied.process_settings.callback(torch.backends.cuda.enable_cudnn_sdp, True)
        applied.notes.append(CUDNN_ATTENTION_OFF)
    shared_values: Dict[str, SharedValues] = {}  # entry key -> its blocks' per-block values
    stochastic_depth: Optional[SyncStochasticDepth] = None
    for region, kwargs in planned:
        # Blocks of one structure share an entry (one graph); any other region gets its own, so that
        # differently shaped modules of one class (two embeddings, say) never recompile each other.
        key = repr(sorted(kwargs.items())) + (region.structure if region.role == "block" else f"@{region.name}")
        cls = type(region.module)
        entry = _entry_function(cls, key)
        item = CompiledRegion(region, entry, f"{cls.__module__}.{cls.__qualname__}:{key}", kwargs)
        if region.shared_floats or region.indices:
            values = shared_values.get(item.entry_key)
            if values is None:
                on_pinned = functools.partial(_split_by_value, applied, item.entry_key)
                values = SharedValues(region.shared_floats, region.indices, on_pinned)
                shared_values[item.entry_key] = values
                values.prime(entry.__code__)
            item.guard_filter = values.guard_filter
            buffers = share_stochastic_depth(region.module, region.shared_floats)
            applied.process_settings.callback(buffers.undo)
            if buffers.owners:
                if stochastic_depth is None:
                    stochastic_depth = SyncStochasticDepth()
                    applied.interceptors.add(stochastic_depth)
                stochastic_depth.buffers[id(item)] = buffers
        compat.install_compiled_call(
            region.module,
            RegionCall(
                item, item.compile_on(region.module), applied.interceptors, route=item.route if region.indices else None
            ),
        )
        applied.compiled.append(item)
        if region.role == "nested":
            _mark_nested_blocks(applied, root, region)
    blocks = Counter(item.entry_key for item in applied.compiled if item.region.role == "block")
    if any(count > 1 for count in blocks.values()):
        shared = functools.partial(_blocks_share_entry, applied)
        applied.interceptors.add(PromotedInputs(shared, functools.partial(_note_upcast, applied)))
    for name in plan.training_without_cache:
        applied.process_settings.callback(train_without_cache(root.get_submodule(name)).remove)
    for name in plan.eager:
        if plan.enclosing_region(name) is not None:
            module = root.get_submodule(name)
            module.forward = torch.compiler.disable(module.forward)
            applied.eager_inside.append(name)
    setattr(root, APPLIED_ATTR, applied)
    return applied


def _blocks_share_entry(applied: AppliedPolicy, entry_key: str) -> bool:
    """Whether more than one block calls the entry ``entry_key`` now (entries split by value included)."""
    return sum(item.entry_key == entry_key and item.region.role == "block" for item in applied.compiled) > 1


def _note_upcast(applied: AppliedPolicy, name: str) -> None:
    applied.notes.append(
        f"{name} and the blocks sharing its graph: bfloat16/float16 inputs upcast to float32, which the block "
        "promotes them to anyway (its outputs checked equal): one graph instead of one per input dtype"
    )


def _split_by_value(applied: AppliedPolicy, entry_key: str, compiled: Dict[str, Any], pinned: str) -> None:
    """The compiler specialized a value the blocks of ``entry_key`` were to share (``pinned``; no trial trace
    showed it before training): the blocks whose values differ from those compiled (``compiled``) move to entries
    per value, before their first call."""
    moved = []
    for item in [item for item in applied.compiled if item.entry_key == entry_key]:
        values = block_values(item.region.module, [*item.region.shared_floats, *item.region.indices])
        if compiled and all(values.get(path) == value for path, value in compiled.items()):
            continue
        item.entry_key = f"{entry_key}|{sorted(values.items())!r}"
        item.entry = _entry_function(type(item.region.module), item.entry_key)
        item.guard_filter = None
        compat.compiled_call(item.region.module).compiled = item.compile_on(item.region.module)
        moved.append(item.region.name)
    if moved:
        applied.notes.append(
            f"the compiler specialized a value the blocks were to share ({pinned}): {len(moved)} blocks "
            f"({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}) compile an entry per value instead"
        )


def format_plan_table(applied: AppliedPolicy) -> str:
    """A fixed-width table of the plan, for the console."""
    rows = applied.rows()
    header = f"compile policy {applied.policy.name!r}"
    if not applied.policy.enabled:
        return f"{header}: disabled, the model runs eagerly"
    if not applied.policy.rules:
        return f"{header}: no module rules, the model runs eagerly (the optimizer section still applies)"
    columns = ["module", "class", "action", "rule", "settings", "shares_graph_with"]
    titles = ["module", "class", "action", "rule", "settings", "shared by"]
    lines = [header, *text_table(titles, [[str(row[c]) for c in columns] for row in rows])]
    groups = applied.shared_counts()
    lines.append(f"{len(applied.compiled)} regions, {len(groups)} distinct compiled entries")
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
        lines.append(f"{setting}, compiled in the foreground: {applied.foreground_reason}")
    elif applied.policy.background:
        lines.append(f"compiled on a background thread while the first steps run eagerly (background: true){lowering}")
    elif deferred:
        lines.append(
            f"{', '.join(deferred)}: compiled on a background thread after the first step, eager until then "
            f"({setting}){lowering}"
        )
    lines += [f"note: {note}" for note in applied.notes]
    return "\n".join(lines)
