"""Building validated schema objects from names, files, dicts and Hydra configs (OmegaConf merges onto the schema)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Type, TypeVar

from compile_trainer.schema.keys import unknown_keys
from compile_trainer.schema.policy import CompilePolicy
from compile_trainer.schema.policy_files import (
    find_policy_file,
    is_policy_path,
    merge_bases,
    policy_names,
    read_policy_file,
    unknown_name_message,
)
from compile_trainer.schema.sweep import SweepSettings, sweep_settings_problems
from compile_trainer.schema.telemetry import TelemetryConfig, telemetry_config_problems
from compile_trainer.schema.validate import PolicyError, validate_policy

Schema = TypeVar("Schema")
# Dicts that an override replaces rather than merges into: pad values name the batch's entries, and a bundled
# policy's entries (by role) beside the user's own would pad entries the user meant to leave alone.
REPLACED_BY_OVERRIDES = ("shapes.pad.values",)


class SettingsError(ValueError):
    """A ``telemetry`` or ``sweep`` setting that cannot work; raised before training starts."""


def bundled_policy_dir() -> Path:
    """``conf/compile``: of this checkout, or of the installed package (a wheel ships ``conf`` inside it)."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "conf" / "compile"
    return checkout if checkout.is_dir() else package / "conf" / "compile"


def bundled_policy_names() -> List[str]:
    return policy_names(bundled_policy_dir())


def to_policy(spec: Any = None, **overrides: Any) -> CompilePolicy:
    """Build a validated policy from a ``CompilePolicy``, a dict/DictConfig of its fields, the name of a bundled
    policy (``"regional"``) or the path of a policy file (``"configs/compile/my_policy.yaml"``, a ``Path``):
    ``compile_trainer.schema.policy_files`` says which a string is.

    ``overrides`` are merged on top, e.g. ``to_policy("regional", backend="aot_eager")``. Checks that need
    the installed torch (the backend exists, ...) run when the policy is applied.
    """
    if isinstance(spec, CompilePolicy) and not overrides:
        return validate_policy(spec)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    unknown = unknown_keys(overrides, CompilePolicy)
    if unknown:
        raise PolicyError(f"invalid compile policy: {'; '.join(unknown)}.")
    try:
        given = _policy_values("regional" if spec is None else spec)
        merged = OmegaConf.merge(OmegaConf.structured(CompilePolicy), given)
        if overrides:
            for path in REPLACED_BY_OVERRIDES:  # a dict an override gives whole, not merged into the bundled one
                if OmegaConf.select(OmegaConf.create(overrides), path) is not None:
                    OmegaConf.update(merged, path, {}, merge=False)
            merged = OmegaConf.merge(merged, overrides)
    except OmegaConfBaseException as error:
        raise PolicyError(f"invalid compile policy: {error}") from error
    return validate_policy(OmegaConf.to_object(merged))


def _policy_values(spec: Any) -> Any:
    """The fields ``spec`` gives, as OmegaConf merges them onto the schema; a file's or a dict's ``defaults`` list
    merged under them (``policy_files``)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, CompilePolicy):
        return OmegaConf.structured(spec)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and is_policy_path(spec)):
        return read_policy_file(find_policy_file(spec), bundled_policy_dir())
    if isinstance(spec, str):
        path = bundled_policy_dir() / f"{spec}.yaml"
        if not path.is_file():
            raise PolicyError(unknown_name_message(spec, bundled_policy_names()))
        return read_policy_file(path, bundled_policy_dir())
    values = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else spec
    if not isinstance(values, Mapping):
        raise PolicyError(
            "a compile policy is a bundled policy's name, a policy file's path, a dict (or DictConfig) of its fields "
            f"or a CompilePolicy; got {type(spec).__name__} {spec!r}."
        )
    values = dict(values)
    defaults = values.pop("defaults", None)  # a policy file read with OmegaConf.load, or a YAML mapping like one
    unknown = unknown_keys(values, CompilePolicy)
    if unknown:
        raise PolicyError(f"invalid compile policy: {'; '.join(unknown)}.")
    bases = merge_bases(defaults, [bundled_policy_dir()], bundled_policy_dir(), "compile policy")
    return OmegaConf.merge(bases, values)


def policy_to_dict(policy: CompilePolicy) -> Dict[str, Any]:
    return dataclasses.asdict(policy)


def _settings(cls: Type[Schema], spec: Any, section: str) -> Schema:
    """``cls`` from an instance or a dict/DictConfig of its fields; unknown fields name the valid ones."""
    if isinstance(spec, cls):
        return spec
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec or {})
    unknown = unknown_keys(values, cls, root=section)
    if unknown:
        raise SettingsError(f"{'; '.join(unknown)}.")
    return cls(**values)


def to_telemetry_config(spec: Any = True) -> TelemetryConfig:
    """A validated ``TelemetryConfig`` from a config, a dict/DictConfig of its fields, or a bool (on/off)."""
    if spec is None or isinstance(spec, bool):
        config = TelemetryConfig(enabled=spec is not False)
    else:
        config = _settings(TelemetryConfig, spec, "telemetry")
    for problem in telemetry_config_problems(config):
        raise SettingsError(f"{problem}.")
    return config


def to_sweep_settings(spec: Any) -> SweepSettings:
    settings = _settings(SweepSettings, spec, "sweep")
    for problem in sweep_settings_problems(settings):
        raise SettingsError(f"{problem}.")
    return settings
