"""Hydra ConfigStore registration: schemas that validate the composed configs.

``compile/schema`` types the compile policies; ``trainer/schema`` is generated from
``lightning.pytorch.Trainer``'s signature, so every Trainer argument can be overridden from the
command line (``trainer.gradient_clip_val=1.0``) and a misspelt one fails at composition.
``sweep_schema`` types the ``sweep`` node (``compile_trainer.schema.SweepSettings``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import lightning.pytorch as pl
from hydra.core.config_store import ConfigStore

from compile_trainer.schema import CompilePolicy, SweepSettings, TelemetryConfig

# Passed in code, not from the config.
TRAINER_ARGS_SET_IN_CODE = ("self", "logger", "callbacks", "plugins", "profiler", "model_registry")


def trainer_schema() -> type:
    """A dataclass with one field per ``Trainer`` argument and Lightning's own defaults."""
    fields = [("_target_", str, dataclasses.field(default="lightning.pytorch.Trainer"))]
    for name, parameter in inspect.signature(pl.Trainer.__init__).parameters.items():
        if name in TRAINER_ARGS_SET_IN_CODE or parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        default = parameter.default
        if not isinstance(default, (str, int, float, bool, type(None))):
            default = None
        fields.append((name, Optional[Any], dataclasses.field(default=default)))
    return dataclasses.make_dataclass("TrainerConfig", fields)


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(group="compile", name="schema", node=CompilePolicy)
    store.store(group="trainer", name="schema", node=trainer_schema())
    store.store(group="telemetry", name="schema", node=TelemetryConfig)
    store.store(name="sweep_schema", node=SweepSettings)
