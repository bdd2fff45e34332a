"""The compile policy schema: typed dataclasses, validated before anything is compiled.

A policy has global compile settings and an ordered list of rules. Each rule selects
submodules (by qualified-name glob and/or class name) and says what to do with them:
``full`` (compile the module whole), ``regional`` (compile each repeated block under it
in place, so identical blocks share one compiled graph) or ``eager`` (never compile it).
Later rules refine earlier ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from compile_trainer.shapes import ShapesPolicy, shape_policy_problems

ACTIONS = ("full", "regional", "eager")
REST_ACTIONS = ("eager", "compile", "nested")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SETTING_FIELDS = ("backend", "mode", "fullgraph", "dynamic", "options")
OPTIMIZER_COMPILE = ("true", "false", "auto")
OPTIMIZER_CANDIDATES = ("fused", "foreach", "compiled")


class PolicyError(ValueError):
    """A policy that cannot be applied; raised before training starts."""


@dataclass
class Rule:
    """Select submodules and say how to compile them.

    ``name`` is a glob over qualified module names relative to the LightningModule
    (``*`` matches one name segment, ``**`` any number, e.g. ``model.blocks.*``);
    ``class_name`` matches the module's class name (a glob too, e.g. ``Block``).
    A module must match every field given. The settings fields override the policy's.
    """

    name: Optional[str] = None
    class_name: Optional[str] = None
    action: str = "full"
    # For ``regional``: what to do with the parts under the module that are not repeated blocks
    # (embedding, final norm, head...): ``compile`` each as its own region, leave them ``eager``, or
    # ``nested``: compile the module whole, with each repeated block marked as a nested compile region
    # (``torch.compiler.nested_compile_region``) so that it is traced and compiled once and reused.
    rest: str = "eager"
    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Optional[Dict[str, Any]] = None

    def describe(self) -> str:
        parts = [
            f"name={self.name!r}" if self.name else "",
            f"class_name={self.class_name!r}" if self.class_name else "",
        ]
        return f"Rule({', '.join(p for p in parts if p)}, action={self.action!r})"


@dataclass
class CompileSettings:
    """The ``torch.compile`` arguments that a region is compiled with."""

    backend: str = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Dict[str, Any] = field(default_factory=dict)

    def overridden_by(self, rule: Rule) -> CompileSettings:
        changes = {f: getattr(rule, f) for f in SETTING_FIELDS if getattr(rule, f) is not None}
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        text = f"backend={self.backend} mode={self.mode or 'default'} fullgraph={self.fullgraph}"
        text += f" dynamic={self.dynamic}"
        if self.options:
            text += f" options={dict(self.options)}"
        return text


@dataclass
class OptimizerPolicy:
    """How each optimizer's ``step`` runs (see ``compile_trainer.optimizer``).

    ``compile``: ``true`` replaces the step with a compiled update whose hyperparameters are tensors
    (LR schedules never recompile); ``auto`` times ``auto_candidates`` on the real parameters during
    the first steps and keeps the fastest; ``false`` leaves the optimizer alone. Independent of the
    policy's ``enabled``. ``backend`` defaults to the policy's backend.
    """

    compile: str = "false"
    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: bool = True
    options: Dict[str, Any] = field(default_factory=dict)
    auto_candidates: List[str] = field(default_factory=lambda: list(OPTIMIZER_CANDIDATES))
    # Timed steps per candidate for ``auto``, after one untimed warm-up step each (which compiles).
    auto_steps: int = 3


@dataclass
class CompilePolicy:
    """A whole compile policy: global settings plus ordered rules.

    ``enabled: false`` (the ``none`` policy) trains eagerly but keeps the telemetry.
    """

    name: str = "custom"
    enabled: bool = True
    backend: str = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Dict[str, Any] = field(default_factory=dict)
    # Dynamo's per-frame recompile limit; past it a frame silently runs eagerly.
    recompile_limit: int = 8
    # Compile on a background thread while the first steps run eagerly (compile_trainer.background).
    background: bool = False
    rules: List[Rule] = field(default_factory=list)
    # Variable-length batches: mark_dynamic axes, padding buckets, warm-up, strict recompiles.
    shapes: ShapesPolicy = field(default_factory=ShapesPolicy)
    optimizer: OptimizerPolicy = field(default_factory=OptimizerPolicy)

    @property
    def settings(self) -> CompileSettings:
        return CompileSettings(self.backend, self.mode, self.fullgraph, self.dynamic, dict(self.options))


def available_backends() -> List[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def _check_settings(where: str, backend: Optional[str], mode: Optional[str]) -> None:
    if backend is not None and backend not in available_backends():
        raise PolicyError(f"{where}: unknown backend {backend!r}. Valid backends: {', '.join(available_backends())}.")
    if mode is not None and mode not in MODES:
        raise PolicyError(f"{where}: invalid mode {mode!r}. Valid modes: {', '.join(MODES)}.")


def validate_policy(policy: CompilePolicy) -> CompilePolicy:
    """Check values that the type system cannot; raise ``PolicyError`` naming what is valid."""
    where = f"compile policy {policy.name!r}"
    _check_settings(where, policy.backend, policy.mode)
    if policy.recompile_limit < 1:
        raise PolicyError(f"{where}: recompile_limit must be >= 1, got {policy.recompile_limit}.")
    if policy.enabled and not policy.rules:
        raise PolicyError(f"{where}: enabled but has no rules; add a rule such as {{name: '*', action: full}}.")
    for index, rule in enumerate(policy.rules):
        rule_where = f"{where}, rule {index} {rule.describe()}"
        if rule.name is None and rule.class_name is None:
            raise PolicyError(f"{rule_where}: give `name` (a qualified-name glob) or `class_name`, or both.")
        if rule.action not in ACTIONS:
            raise PolicyError(f"{rule_where}: invalid action {rule.action!r}. Valid actions: {', '.join(ACTIONS)}.")
        if rule.rest not in REST_ACTIONS:
            raise PolicyError(f"{rule_where}: invalid rest {rule.rest!r}. Valid values: {', '.join(REST_ACTIONS)}.")
        _check_settings(rule_where, rule.backend, rule.mode)
    for problem in shape_policy_problems(policy):
        raise PolicyError(f"{where}: {problem}.")
    if policy.background:
        _check_background(where, policy)
    validate_optimizer_policy(policy.optimizer, f"{where}, optimizer")
    return policy


def _check_background(where: str, policy: CompilePolicy) -> None:
    from compile_trainer.background import background_compile_problem

    problem = background_compile_problem()
    if problem:
        raise PolicyError(f"{where}: background: true {problem}.")
    nested = [index for index, rule in enumerate(policy.rules) if rule.action == "regional" and rule.rest == "nested"]
    if nested:
        raise PolicyError(
            f"{where}: background: true with rest: nested (rule {nested[0]}) is not supported: compiling nested "
            "regions on a background thread failed on an H100 (torch 2.11); use rest: compile, or background: false."
        )
    if policy.shapes.warmup:
        raise PolicyError(
            f"{where}: background: true and shapes.warmup: true both decide when compiles happen (warm-up compiles "
            "every bucket before the first step; background compiles while eager steps run); set one of them false."
        )


def validate_optimizer_policy(optimizer: OptimizerPolicy, where: str = "optimizer policy") -> OptimizerPolicy:
    optimizer.compile = str(optimizer.compile).lower()  # YAML's `true` arrives as the string "True"
    if optimizer.compile not in OPTIMIZER_COMPILE:
        raise PolicyError(
            f"{where}: invalid compile {optimizer.compile!r}. Valid values: {', '.join(OPTIMIZER_COMPILE)}."
        )
    _check_settings(where, optimizer.backend, optimizer.mode)
    unknown = [c for c in optimizer.auto_candidates if c not in OPTIMIZER_CANDIDATES]
    if unknown or not optimizer.auto_candidates:
        raise PolicyError(
            f"{where}: invalid auto_candidates {list(optimizer.auto_candidates)}. "
            f"Give one or more of: {', '.join(OPTIMIZER_CANDIDATES)}."
        )
    if optimizer.auto_steps < 1:
        raise PolicyError(f"{where}: auto_steps must be >= 1, got {optimizer.auto_steps}.")
    return optimizer


def bundled_policy_dir() -> Path:
    """``conf/compile``: of this checkout, or of the installed package (a wheel ships ``conf`` inside it)."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "conf" / "compile"
    return checkout if checkout.is_dir() else package / "conf" / "compile"


def bundled_policy_names() -> List[str]:
    return sorted(p.stem for p in bundled_policy_dir().glob("*.yaml"))


def to_policy(spec: Any = None, **overrides: Any) -> CompilePolicy:
    """Build a validated policy from a ``CompilePolicy``, a dict/DictConfig, or a bundled policy name.

    ``overrides`` are merged on top, e.g. ``to_policy("regional", backend="aot_eager")``.
    """
    if isinstance(spec, CompilePolicy) and not overrides:
        return validate_policy(spec)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(CompilePolicy)
    try:
        if spec is None:
            spec = "regional"
        if isinstance(spec, str):
            path = bundled_policy_dir() / f"{spec}.yaml"
            if not path.is_file():
                raise PolicyError(
                    f"unknown compile policy {spec!r}. Bundled policies: {', '.join(bundled_policy_names())}."
                )
            loaded = OmegaConf.load(path)
            loaded.pop("defaults", None)
            if "name" not in loaded:
                loaded.name = spec
            merged = OmegaConf.merge(schema, loaded)
        elif isinstance(spec, CompilePolicy):
            merged = OmegaConf.merge(schema, OmegaConf.structured(spec))
        else:
            merged = OmegaConf.merge(schema, spec)
        if overrides:
            merged = OmegaConf.merge(merged, overrides)
    except OmegaConfBaseException as error:
        raise PolicyError(f"invalid compile policy: {error}") from error
    return validate_policy(OmegaConf.to_object(merged))


def policy_to_dict(policy: CompilePolicy) -> Dict[str, Any]:
    return dataclasses.asdict(policy)
