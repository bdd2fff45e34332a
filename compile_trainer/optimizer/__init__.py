"""Compiled optimizer steps: tensor hyperparameters, the optimizer's own state, ``auto`` among candidates."""

from compile_trainer.optimizer.auto import OptimizerChoice
from compile_trainer.optimizer.compiled_step import CompiledOptimizerStep, compile_optimizer
from compile_trainer.optimizer.trainer_steps import compile_optimizers, describe_steps, take_over_clipping

__all__ = [
    "CompiledOptimizerStep",
    "OptimizerChoice",
    "compile_optimizer",
    "compile_optimizers",
    "describe_steps",
    "take_over_clipping",
]
