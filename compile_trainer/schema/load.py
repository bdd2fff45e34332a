"""Building validated schema objects from names, dicts and Hydra configs (OmegaConf merges onto the schema)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Tuple, Type, TypeVar

from compile_trainer.schema.keys import unknown_keys
from compile_trainer.schema.policy import CompilePolicy
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
    return sorted(p.stem for p in bundled_policy_dir().glob("*.yaml"))


def to_policy(spec: Any = None, **overrides: Any) -> CompilePolicy:
    """Build a validated policy from a ``CompilePolicy``, a dict/DictConfig, or a bundled policy name.

    ``overrides`` are merged on top, e.g. ``to_policy("regional", backend="aot_eager")``. Checks that need
    the installed torch (the backend exists, ...) run when the policy is applied.
    """
    if isinstance(spec, CompilePolicy) and not overrides:
        return validate_policy(spec)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(CompilePolicy)
    if spec is None:
        spec = "regional"
    try:
        # keys OmegaConf would refuse as "Key 'bakend' not in 'CompilePolicy'", named with what is valid
        given = {} if isinstance(spec, (str, CompilePolicy)) else OmegaConf.to_container(OmegaConf.create(spec))
        unknown = unknown_keys(given, CompilePolicy) + unknown_keys(overrides, CompilePolicy)
        if unknown:
            raise PolicyError(f"invalid compile policy: {'; '.join(unknown)}.")
        if isinstance(spec, str):
            merged = OmegaConf.merge(schema, _load_bundled(spec))
        elif isinstance(spec, CompilePolicy):
            merged = OmegaConf.merge(schema, OmegaConf.structured(spec))
        else:
            merged = OmegaConf.merge(schema, spec)
        if overrides:
            for path in REPLACED_BY_OVERRIDES:  # a dict an override gives whole, not merged into the bundled one
                if OmegaConf.select(OmegaConf.create(overrides), path) is not None:
                    OmegaConf.update(merged, path, {}, merge=False)
            merged = OmegaConf.merge(merged, overrides)
    except OmegaConfBaseException as error:
        raise PolicyError(f"invalid compile policy: {error}") from error
    return validate_policy(OmegaConf.to_object(merged))


def _load_bundled(name: str, including: Tuple[str, ...] = ()) -> Any:
    """Bundled policy ``name`` as Hydra composes it: the bundled policies its ``defaults`` list first (a policy
    may build on another: ``dynamic_full`` on ``dynamic``), then its own keys; lists are replaced, not appended.
    The list's other entries (``schema``, ``_self_`` last, recipe overrides) concern Hydra alone."""
    from omegaconf import OmegaConf

    path = bundled_policy_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PolicyError(f"unknown compile policy {name!r}. Bundled policies: {', '.join(bundled_policy_names())}.")
    if name in including:
        raise PolicyError(f"compile policy {name!r} includes itself: {' -> '.join((*including, name))}.")
    loaded = OmegaConf.load(path)
    bases = [entry for entry in loaded.pop("defaults", None) or [] if isinstance(entry, str)]
    unknown = unknown_keys(OmegaConf.to_container(loaded), CompilePolicy)
    if unknown:
        raise PolicyError(f"compile policy {name!r} ({path}): {'; '.join(unknown)}.")
    merged = OmegaConf.create()
    for base in bases:
        if base not in ("schema", "_self_"):
            merged = OmegaConf.merge(merged, _load_bundled(base, (*including, name)))
    merged = OmegaConf.merge(merged, loaded)
    merged.name = loaded.get("name", name)
    return merged


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
