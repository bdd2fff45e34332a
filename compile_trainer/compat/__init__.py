"""Every private torch API the library uses, in one place, with the torch versions it was checked on.

The rule of the door: the rest of the package reaches torch's internals (a ``torch._x`` name, a private module, a
private attribute, a text Dynamo prints) only through ``compile_trainer.compat``, and compat imports nothing of the
package above it (tests/test_compat.py and tests/test_architecture.py check both). Callers write ``compat.x`` or
``from compile_trainer.compat import x``; the names below are the whole of it.

One module per torch subsystem, each with its adapters at the top, its probes at the bottom and ``ENTRIES``: one
``Entry`` per door, recording torch's qualified names of what it reaches, the versions it was checked on, the
upstream issues and PRs, and, as ``Obsolete`` records, code kept for torch versions older than a given one.
``ENTRIES`` below gathers them: ``tests/test_compat.py`` runs every probe on the installed torch (so a torch upgrade
that moves or changes one fails there first, by name), checks every entry's record, and fails once the oldest
supported torch (pyproject.toml's ``torch>=X.Y``) makes an entry's ``Obsolete`` code removable.

To add an entry: write the adapter in the module of its subsystem (a new module for a new subsystem, added to
``_MODULES``), name it in that module's ``__all__`` and in the imports below, and add an ``Entry`` to the module's
``ENTRIES`` with a probe that uses it as the library does and asserts what the library relies on (names, fields,
texts, effects), compiling with the eager backend on a fresh code object (``entry.fresh``).

Supported: torch >= 2.9 (checked on 2.9.1, 2.13.0 on the CPU; 2.11.0 on an H100).
"""

from . import (
    backends,
    cudagraphs,
    dynamo_config,
    dynamo_events,
    dynamo_texts,
    flop_counting,
    inductor,
    lowering,
    modules,
    optimizer,
    precompiled,
    shapes,
    threads,
)
from .backends import (
    inductor_backend,
    inductor_mode_options,
    inductor_options_without_size_guards,
    list_backends,
    lookup_backend,
)
from .cudagraphs import TREE_CONTAINERS, cudagraph_skips, cudagraph_warmed_up_functions, import_cudagraph_trees
from .dynamo_config import (
    LoggerMethodName,
    compiler_collectives,
    dynamo_config_loggable,
    ignored_logger_methods,
    recompile_limit,
    set_compiler_collectives,
    set_ignored_logger_methods,
    set_optimize_ddp,
    set_recompile_limit,
    turn_off_ddp_optimizer,
)
from .dynamo_events import (
    compilation_metrics,
    dynamo_callback_handler,
    functions_closed_over,
    graph_break_reasons,
    unique_graphs,
)
from .dynamo_texts import (
    GRAD_MODE_GUARD,
    REQUIRES_GRAD_GUARD,
    is_fail_on_recompile,
    is_recompile_limit,
    reports_frames_run_eagerly_at_a_loop_break,
    traced_error_summary,
)
from .entry import Entry, Obsolete, needs_torch, renamed_function, torch_version
from .flop_counting import (
    FlopTally,
    fake_tensor_mode,
    flop_counting_problem,
    is_compiled_autograd_node,
    outside_dispatch_modes,
    run_graph_inlining_subgraphs,
)
from .inductor import (
    cache_counters,
    fork_compile_workers,
    fresh_inductor_cache,
    inductor_cache_dir,
    prefetch_compiler_keys,
    warm_compile_workers,
)
from .lowering import (
    SubprocessLowerings,
    eager_backward_lowering,
    eager_backward_lowering_problem,
    lowering_in_subprocess,
    subprocess_lowering_problem,
    warm_subprocess_lowering,
)
from .modules import (
    call_uncompiled,
    compiled_call,
    install_compiled_call,
    is_nested_compile_region,
    user_compiled,
)
from .optimizer import (
    LR_SCHEDULER_WRAPPED,
    fused_unsupported_reason,
    mark_optimizer_stepped,
    optimizer_step_hooks,
    set_step_handles_amp_scaling,
)
from .precompiled import (
    aot_changed_sources,
    aot_compile,
    aot_compile_problem,
    load_aot_compiled,
    serialize_aot_compiled,
)
from .shapes import (
    copy_dynamo_marks,
    float_source,
    guard_code_parts,
    mark_dynamic,
    mark_static_address,
    maybe_mark_dynamic,
    prime_dynamic_floats,
)
from .threads import compile_session_owner, fx_patcher, fx_tracing_check, run_as_plain_python

# The modules of the door, in the order their entries are probed.
_MODULES = (
    dynamo_events,
    dynamo_texts,
    dynamo_config,
    backends,
    shapes,
    modules,
    threads,
    inductor,
    cudagraphs,
    lowering,
    precompiled,
    optimizer,
    flop_counting,
)
ENTRIES = [entry for module in _MODULES for entry in module.ENTRIES]

__all__ = [
    "ENTRIES",
    "Entry",
    "FlopTally",
    "GRAD_MODE_GUARD",
    "LR_SCHEDULER_WRAPPED",
    "LoggerMethodName",
    "Obsolete",
    "REQUIRES_GRAD_GUARD",
    "SubprocessLowerings",
    "TREE_CONTAINERS",
    "aot_changed_sources",
    "aot_compile",
    "aot_compile_problem",
    "cache_counters",
    "call_uncompiled",
    "compilation_metrics",
    "compile_session_owner",
    "compiled_call",
    "compiler_collectives",
    "copy_dynamo_marks",
    "cudagraph_skips",
    "cudagraph_warmed_up_functions",
    "dynamo_callback_handler",
    "dynamo_config_loggable",
    "eager_backward_lowering",
    "eager_backward_lowering_problem",
    "fake_tensor_mode",
    "float_source",
    "flop_counting_problem",
    "fork_compile_workers",
    "fresh_inductor_cache",
    "functions_closed_over",
    "fused_unsupported_reason",
    "fx_patcher",
    "fx_tracing_check",
    "graph_break_reasons",
    "guard_code_parts",
    "ignored_logger_methods",
    "import_cudagraph_trees",
    "inductor_backend",
    "inductor_cache_dir",
    "inductor_mode_options",
    "inductor_options_without_size_guards",
    "install_compiled_call",
    "is_compiled_autograd_node",
    "is_fail_on_recompile",
    "is_nested_compile_region",
    "is_recompile_limit",
    "list_backends",
    "load_aot_compiled",
    "lookup_backend",
    "lowering_in_subprocess",
    "mark_dynamic",
    "mark_optimizer_stepped",
    "mark_static_address",
    "maybe_mark_dynamic",
    "needs_torch",
    "optimizer_step_hooks",
    "outside_dispatch_modes",
    "prefetch_compiler_keys",
    "prime_dynamic_floats",
    "recompile_limit",
    "renamed_function",
    "reports_frames_run_eagerly_at_a_loop_break",
    "run_as_plain_python",
    "run_graph_inlining_subgraphs",
    "serialize_aot_compiled",
    "set_compiler_collectives",
    "set_ignored_logger_methods",
    "set_optimize_ddp",
    "set_recompile_limit",
    "set_step_handles_amp_scaling",
    "subprocess_lowering_problem",
    "torch_version",
    "traced_error_summary",
    "turn_off_ddp_optimizer",
    "unique_graphs",
    "user_compiled",
    "warm_compile_workers",
    "warm_subprocess_lowering",
]
