"""Hydra ConfigStore registration: schemas that validate the composed configs.

``compile/schema`` types the compile policies; ``trainer/schema`` is generated from
``lightning.pytorch.Trainer``'s signature, so every Trainer argument can be overridden from the
command line (``trainer.gradient_clip_val=1.0``) and a misspelt one fails at composition.
``sweep_schema`` types the ``sweep`` node (``compile_trainer.schema.SweepSettings``).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
from hydra.core.config_store import ConfigStore

from compile_trainer.schema import CompilePolicy, SweepSettings, TelemetryConfig
from compile_trainer.schema.keys import unknown_dotted_key, unknown_keys

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


def _schemas() -> Dict[str, type]:
    """The config's typed sections: a key under one of them that its schema lacks fails Hydra's composition."""
    return {"compile": CompilePolicy, "trainer": trainer_schema(), "telemetry": TelemetryConfig}


def unknown_override_keys(overrides: List[str], config_dirs: List[Path]) -> List[str]:
    """Keys that Hydra would refuse with OmegaConf's bare "Key 'bakend' not in 'CompilePolicy'", named with the
    nearest valid key and every valid key of their section: in command-line overrides (``compile.bakend=eager``,
    ``compile.rules=[{acton: full}]``) and in the policy files a group override selects (``compile=my_policy``,
    looked up in ``config_dirs`` in order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    schemas, problems = _schemas(), []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete():
            continue
        section, *path = override.key_or_group.split(".")
        if section not in schemas:
            continue
        if path:
            value = None if override.is_sweep_override() else override.value()
            problems += unknown_dotted_key(path, schemas[section], section, value)
            continue
        choices = override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]
        for choice in choices:  # a group choice: compile=my_policy is conf/compile/my_policy.yaml
            found = [d / section / f"{choice}.yaml" for d in config_dirs if (d / section / f"{choice}.yaml").is_file()]
            if found:
                loaded = OmegaConf.to_container(OmegaConf.load(found[0]))
                loaded.pop("defaults", None)
                problems += [f"{found[0]}: {p}" for p in unknown_keys(loaded, schemas[section], section)]
    return problems


def exit_on_unknown_keys(argv: List[str], config_dir: Path) -> None:
    """Before Hydra composes the config: exit (status 1, as Hydra's own errors) naming each unknown key in the
    command line's overrides and the policy files they select, with what is valid."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself reads the command line with

    args = get_args_parser().parse_args(argv)
    extra = [Path(args.config_dir)] if args.config_dir else []
    problems = unknown_override_keys(args.overrides, [*extra, config_dir])
    if problems:
        sys.exit("Could not compose the config:\n" + "\n".join(problems))
