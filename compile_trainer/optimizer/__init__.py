"""Compiled optimizer steps: tensor hyperparameters, the optimizer's own state, ``auto`` among candidates."""

from compile_trainer.optimizer.compiled_step import (
    CompiledOptimizerStep,
    OptimizerChoice,
    compile_optimizer,
    compile_optimizers,
    describe_steps,
)

__all__ = ["CompiledOptimizerStep", "OptimizerChoice", "compile_optimizer", "compile_optimizers", "describe_steps"]
