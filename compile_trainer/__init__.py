"""compile_trainer: declared torch.compile policies for Lightning training."""

from compile_trainer.apply import AppliedPolicy, apply_policy, format_plan_table
from compile_trainer.background import BackgroundCompile, BackgroundCompileError
from compile_trainer.callback import CompileCallback
from compile_trainer.cuda_graph_grads import GradientCopies, copy_cuda_graph_gradients
from compile_trainer.optimizer import CompiledOptimizerStep, OptimizerChoice, compile_optimizer
from compile_trainer.policy import CompilePolicy, OptimizerPolicy, PolicyError, Rule, to_policy
from compile_trainer.selection import CompilePlan, find_repeated_blocks, resolve_plan
from compile_trainer.shapes import BatchShaper, PadCollate, ShapeError, ShapesPolicy
from compile_trainer.warmup import RecompileError

__all__ = [
    "AppliedPolicy",
    "BackgroundCompile",
    "BackgroundCompileError",
    "BatchShaper",
    "CompileCallback",
    "CompilePlan",
    "CompilePolicy",
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
    "apply_policy",
    "compile_optimizer",
    "copy_cuda_graph_gradients",
    "find_repeated_blocks",
    "format_plan_table",
    "resolve_plan",
    "to_policy",
]
