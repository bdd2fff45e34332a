"""The schema layer: every declaration of a policy and its pure checks; imports nothing of the runtime.

``CompileSettings`` (declared once), ``Rule``, ``CompilePolicy``, ``OptimizerPolicy``, ``ShapesPolicy``,
``TelemetryConfig``, ``SweepSettings``, ``CacheSettings``; ``validate_policy`` and friends check them without torch, and
``to_policy`` builds a validated policy from a bundled name, a dict or a Hydra config.
"""

from compile_trainer.schema.cache import CacheSettings
from compile_trainer.schema.distributed import DistributedSettings
from compile_trainer.schema.load import (
    SettingsError,
    bundled_policy_dir,
    bundled_policy_names,
    policy_to_dict,
    to_policy,
    to_sweep_settings,
    to_telemetry_config,
)
from compile_trainer.schema.policy import CompilePolicy, OptimizerPolicy, Rule, optimizer_settings
from compile_trainer.schema.settings import CompileSettings, SettingsOverrides
from compile_trainer.schema.shapes import DynamicDim, Padding, PowersOfTwo, ShapesPolicy
from compile_trainer.schema.sweep import SweepSettings
from compile_trainer.schema.telemetry import TelemetryConfig
from compile_trainer.schema.validate import PolicyError, validate_optimizer_policy, validate_policy

__all__ = [
    "CacheSettings",
    "CompilePolicy",
    "CompileSettings",
    "DistributedSettings",
    "DynamicDim",
    "OptimizerPolicy",
    "Padding",
    "PolicyError",
    "PowersOfTwo",
    "Rule",
    "SettingsError",
    "SettingsOverrides",
    "ShapesPolicy",
    "SweepSettings",
    "TelemetryConfig",
    "bundled_policy_dir",
    "bundled_policy_names",
    "optimizer_settings",
    "policy_to_dict",
    "to_policy",
    "to_sweep_settings",
    "to_telemetry_config",
    "validate_optimizer_policy",
    "validate_policy",
]
