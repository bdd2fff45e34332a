"""compile_trainer: declared torch.compile policies for Lightning training.

The package's layers, from the bottom (docs/ARCHITECTURE.md): ``schema`` (declarations and pure checks),
``planning`` (which modules become regions), ``compiling`` (regions, their call chain, backends, background,
CUDA graphs), ``shapes``, ``optimizer``, ``telemetry``, ``lightning`` (the callback), ``runs`` (recipes' runs,
sweeps, report) and ``cli``; ``compat`` is the one door to torch's private APIs.
"""

from typing import TYPE_CHECKING

from compile_trainer.compiling.background import BackgroundCompile, BackgroundCompileError
from compile_trainer.compiling.cuda_graph_grads import GradientCopies, copy_cuda_graph_gradients
from compile_trainer.compiling.plan_table import format_plan_table
from compile_trainer.compiling.regions import AppliedPolicy, apply_policy
from compile_trainer.optimizer import CompiledOptimizerStep, OptimizerChoice, compile_optimizer
from compile_trainer.planning.plan import CompilePlan
from compile_trainer.planning.selection import resolve_plan
from compile_trainer.planning.stacks import find_repeated_blocks
from compile_trainer.schema import (
    CompilePolicy,
    CompileSettings,
    OptimizerPolicy,
    PolicyError,
    Rule,
    ShapesPolicy,
    TelemetryConfig,
    to_policy,
)
from compile_trainer.shapes.batch import BatchShaper, PadCollate, ShapeError
from compile_trainer.shapes.region_inputs import RecompileError

if TYPE_CHECKING:  # imported at first use (below); named here for type checkers and editors
    from compile_trainer.lightning.callback import CompileCallback


def __getattr__(name: str) -> object:
    """``CompileCallback`` is imported at its first use: the rest of the package does not import Lightning (a
    benchmark's raw-loop worker starts seconds sooner)."""
    if name == "CompileCallback":
        from compile_trainer.lightning.callback import CompileCallback

        return CompileCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AppliedPolicy",
    "BackgroundCompile",
    "BackgroundCompileError",
    "BatchShaper",
    "CompileCallback",
    "CompilePlan",
    "CompilePolicy",
    "CompileSettings",
    "CompiledOptimizerStep",
    "GradientCopies",
    "OptimizerChoice",
    "OptimizerPolicy",
    "PadCollate",
    "PolicyError",
    "RecompileError",
    "Rule",
    "ShapeError",
    "ShapesPolicy",
    "TelemetryConfig",
    "apply_policy",
    "compile_optimizer",
    "copy_cuda_graph_gradients",
    "find_repeated_blocks",
    "format_plan_table",
    "resolve_plan",
    "to_policy",
]
