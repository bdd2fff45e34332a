"""Hydra's side: the schemas that type the composed configs, and the checks of a command line and of the composed
config that turn input errors into one screen naming the fix.

``compile/schema`` types the compile policies (every policy file's defaults list names it), ``telemetry/schema``
the telemetry settings; ``trainer/schema`` is generated from ``lightning.pytorch.Trainer``'s signature, so every
Trainer argument can be overridden from the command line (``trainer.gradient_clip_val=1.0``) and a misspelt one
fails at composition. ``sweep_schema`` types the ``sweep`` node (``compile_trainer.schema.SweepSettings``).
A project of its own that puts ``pkg://compile_trainer.conf`` on its search path gets the first two from that
package (``conf/__init__.py``); one that only writes policy files calls ``register_group_schemas()``.

Input errors that ``train.py`` finds itself exit with status 2 (a usage error, as argparse's), without a
traceback: unknown keys and group choices in the command line (``exit_on_bad_command_line``, before Hydra
composes) and, in a single run, a policy or setting that cannot work (``input_errors_exit``: checked before the
run starts, so no ``result.json``). In a multirun such a run fails like any other, with its ``result.json``, and
the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from compile_trainer.compiling.runtime_checks import check_policy_runtime
from compile_trainer.schema import (
    CompilePolicy,
    PolicyError,
    SettingsError,
    SweepSettings,
    TelemetryConfig,
    to_policy,
    to_sweep_settings,
    to_telemetry_config,
)
from compile_trainer.schema.keys import did_you_mean, unknown_dotted_key, unknown_keys

# Exit status of an input error found before training (argparse's for a bad command line); Hydra's own errors: 1.
INPUT_ERROR_STATUS = 2

# Passed in code, not from the config.
TRAINER_ARGS_SET_IN_CODE = ("self", "logger", "callbacks", "plugins", "profiler", "model_registry")


@functools.cache
def trainer_schema() -> type:
    """A dataclass with one field per ``Trainer`` argument and Lightning's own defaults."""
    import lightning.pytorch as pl  # here: a project composing the bundled policies need not import Lightning

    fields = [("_target_", str, dataclasses.field(default="lightning.pytorch.Trainer"))]
    for name, parameter in inspect.signature(pl.Trainer.__init__).parameters.items():
        if name in TRAINER_ARGS_SET_IN_CODE or parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        default = parameter.default
        if not isinstance(default, (str, int, float, bool, type(None))):
            default = None
        fields.append((name, Optional[Any], dataclasses.field(default=default)))
    return dataclasses.make_dataclass("TrainerConfig", fields)


def register_group_schemas() -> None:
    """The schemas the bundled ``compile`` and ``telemetry`` files' defaults lists name (``schema``)."""
    store = ConfigStore.instance()
    store.store(group="compile", name="schema", node=CompilePolicy)
    store.store(group="telemetry", name="schema", node=TelemetryConfig)


def register_configs() -> None:
    """Every schema ``train.py``'s config names."""
    register_group_schemas()
    store = ConfigStore.instance()
    store.store(group="trainer", name="schema", node=trainer_schema())
    store.store(name="sweep_schema", node=SweepSettings)


# The config's typed sections: a key under one of them that its schema lacks fails Hydra's composition. The
# trainer's is made when an override names it (it imports Lightning: seconds, before a typo's message).
SCHEMAS: Dict[str, Callable[[], type]] = {
    "compile": lambda: CompilePolicy,
    "trainer": trainer_schema,
    "telemetry": lambda: TelemetryConfig,
}


def unknown_override_keys(overrides: List[str], config_dirs: List[Path]) -> List[str]:
    """Keys that Hydra would refuse with OmegaConf's bare "Key 'bakend' not in 'CompilePolicy'", named with the
    nearest valid key and every valid key of their section: in command-line overrides (``compile.bakend=eager``,
    ``compile.rules=[{acton: full}]``) and in the policy files a group override selects (``compile=my_policy``,
    looked up in ``config_dirs`` in order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    problems = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete():
            continue
        section, *path = override.key_or_group.split(".")
        if section not in SCHEMAS:
            continue
        schema = SCHEMAS[section]()
        if path:
            value = None if override.is_sweep_override() else override.value()
            problems += unknown_dotted_key(path, schema, section, value)
            continue
        choices = override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]
        for choice in choices:  # a group choice: compile=my_policy is conf/compile/my_policy.yaml
            found = [d / section / f"{choice}.yaml" for d in config_dirs if (d / section / f"{choice}.yaml").is_file()]
            if found:
                loaded = OmegaConf.to_container(OmegaConf.load(found[0]))
                loaded.pop("defaults", None)
                problems += [f"{found[0]}: {p}" for p in unknown_keys(loaded, schema, section)]
    return problems


def group_options(group: str, overrides: List[str], config_dirs: List[Path], config_name: str) -> Optional[List[str]]:
    """The choices of config group ``group`` as Hydra finds them for this command line (in ``config_dirs``, then
    the ``hydra.searchpath`` of the primary config or of the command line), the schemas left out: they type the
    group's files and are no choice; None where Hydra cannot tell (it reports why itself)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.plugins import Plugins
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    Plugins.instance()  # registers the config sources (file://, pkg://, structured://), as hydra.main does
    search_path = ConfigSearchPathImpl()
    search_path.append("hydra", "pkg://hydra.conf")
    for directory in config_dirs:
        search_path.append("main", f"file://{directory}")
    search_path.append("schema", "structured://")
    try:
        with warnings.catch_warnings():  # an unavailable search path: Hydra warns about it when it composes
            warnings.simplefilter("ignore")
            options = ConfigLoaderImpl(search_path).get_group_options(group, None, config_name, overrides)
    except (HydraException, OmegaConfBaseException):
        return None
    return [option for option in options if option != "schema"]


def unknown_group_choices(overrides: List[str], config_dirs: List[Path], config_name: str) -> List[str]:
    """Group choices that no config of the group's is (``compile=regionl``, ``compile=schema``), named with the
    nearest choice and every choice; Hydra's own message lists the schemas as choices."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problems = []
    for override in OverridesParser.create().parse_overrides(overrides):
        group = override.key_or_group
        if override.is_delete() or "." in group or group == "hydra":
            continue
        choices = override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]
        options = group_options(group, overrides, config_dirs, config_name)
        for choice in [c for c in choices if isinstance(c, str) and options and c not in options]:
            what = "policy" if group == "compile" else "config"
            why = f"the schema that the {group} files build on, not a {what}" if choice == "schema" else f"no {what}"
            near = did_you_mean(choice, options)
            problems.append(f"{group}={choice}: {why} of the group{near}; choices: {', '.join(options)}")
    return problems


def exit_on_bad_command_line(argv: List[str], config_dir: Path, config_name: str = "config") -> None:
    """Before Hydra composes the config: exit (status 2) naming each unknown key in the command line's overrides
    and the policy files they select, and each unknown group choice, with what is valid."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself reads the command line with

    args = get_args_parser().parse_args(argv)
    config_dirs = [*([Path(args.config_dir).resolve()] if args.config_dir else []), config_dir]
    problems = unknown_group_choices(args.overrides, config_dirs, args.config_name or config_name)
    problems += unknown_override_keys(args.overrides, config_dirs)
    if problems:
        print("Could not compose the config:\n" + "\n".join(problems), file=sys.stderr)
        sys.exit(INPUT_ERROR_STATUS)


def check_config(cfg: DictConfig) -> None:
    """Raise ``PolicyError`` or ``SettingsError`` for what cannot work in the composed config's policy (the checks
    that need the installed torch included), telemetry or sweep settings: what building the callback would find."""
    policy = OmegaConf.to_container(cfg.compile, resolve=True) if "compile" in cfg else None
    check_policy_runtime(to_policy(policy))
    to_telemetry_config(OmegaConf.to_container(cfg.telemetry, resolve=True) if "telemetry" in cfg else True)
    to_sweep_settings(cfg.get("sweep"))


@contextmanager
def input_errors_exit(cfg: DictConfig) -> Iterator[None]:
    """A single run's input errors end the process with their message and status 2, not a traceback: the composed
    config is checked first (``check_config``; an error there leaves no ``result.json``: nothing ran), and a
    ``PolicyError`` or ``SettingsError`` the run raises (a rule that matches no module of the model) ends it the same
    way, after its ``result.json``. In a multirun they propagate: that run fails with its ``result.json``, and the
    sweep goes on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        yield
        return
    try:
        check_config(cfg)
        yield
    except (PolicyError, SettingsError) as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(INPUT_ERROR_STATUS)
