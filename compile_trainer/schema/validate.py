"""Checks of a policy that need nothing but the policy: raised as ``PolicyError`` naming what is valid.

Checks that need the installed torch (which backends exist, whether background compilation or nested
regions work) run where the policy is applied: ``compile_trainer.compiling.runtime_checks``.
"""

from __future__ import annotations

from typing import List, Optional

from compile_trainer.schema.cache import cache_settings_problems
from compile_trainer.schema.policy import (
    ACTIONS,
    BACKGROUND_LOWERINGS,
    OPTIMIZER_CANDIDATES,
    OPTIMIZER_COMPILE,
    OPTIMIZER_KERNELS,
    REST_ACTIONS,
    UNNAMED,
    CompilePolicy,
    OptimizerPolicy,
)
from compile_trainer.schema.settings import MODES
from compile_trainer.schema.shapes import dynamic_problems, padding_problems

SCHEMA_ALONE = (
    " (with compile=schema: that selects the schema that policy files build on, not a policy; choose one, such as "
    "compile=regional)"
)


class PolicyError(ValueError):
    """A policy that cannot be applied; raised before training starts."""


def check_mode(where: str, mode: Optional[str]) -> None:
    if mode is not None and mode not in MODES:
        raise PolicyError(f"{where}: invalid mode {mode!r}. Valid modes: {', '.join(MODES)}.")


def validate_policy(policy: CompilePolicy) -> CompilePolicy:
    """Check values that the type system cannot; raise ``PolicyError`` naming what is valid."""
    where = policy.label
    check_mode(where, policy.mode)
    if policy.recompile_limit < 1:
        raise PolicyError(f"{where}: recompile_limit must be >= 1, got {policy.recompile_limit}.")
    if policy.regional_min_reuse < 0:
        raise PolicyError(
            f"{where}: regional_min_reuse must be >= 0 (blocks per distinct structure; 0 = always regional), "
            f"got {policy.regional_min_reuse}."
        )
    if not 0 <= policy.regional_outer_min_share <= 1:
        raise PolicyError(
            f"{where}: regional_outer_min_share must be in [0, 1] (the share of a module's parameters outside its "
            f"blocks from which rest: auto compiles it whole around them), got {policy.regional_outer_min_share}."
        )
    validate_optimizer_policy(policy.optimizer, f"{where}, optimizer")
    if policy.enabled and not policy.rules and policy.optimizer.compile == "false":
        schema_alone = SCHEMA_ALONE if policy.name == UNNAMED else ""  # what compile=schema composes
        raise PolicyError(
            f"{where}: enabled but has no rules and does not compile the optimizer; add a rule such as "
            "{name: '*', action: full}, or set optimizer.compile (true or auto) for an optimizer-only policy"
            f"{schema_alone}."
        )
    for index, rule in enumerate(policy.rules):
        rule_where = f"{where}, rule {index} {rule.describe()}"
        if rule.name is None and rule.class_name is None:
            raise PolicyError(f"{rule_where}: give `name` (a qualified-name glob) or `class_name`, or both.")
        if rule.action not in ACTIONS:
            raise PolicyError(f"{rule_where}: invalid action {rule.action!r}. Valid actions: {', '.join(ACTIONS)}.")
        if rule.rest not in REST_ACTIONS:
            raise PolicyError(f"{rule_where}: invalid rest {rule.rest!r}. Valid values: {', '.join(REST_ACTIONS)}.")
        check_mode(rule_where, rule.mode)
    for problem in shape_policy_problems(policy) + cache_settings_problems(policy.cache):
        raise PolicyError(f"{where}: {problem}.")
    if policy.background_lowering not in BACKGROUND_LOWERINGS:
        raise PolicyError(
            f"{where}: invalid background_lowering {policy.background_lowering!r}. Valid values: "
            f"{', '.join(BACKGROUND_LOWERINGS)}."
        )
    if policy.background:
        _check_background(where, policy)
    _check_background_rest(where, policy)
    return policy


def _check_background_rest(where: str, policy: CompilePolicy) -> None:
    deferring = policy.regional_rules_with_rest("background")
    if not deferring or not policy.enabled:
        return
    clashes = [
        (policy.shapes.warmup, "shapes.warmup: true", "the warm-up decides when compiles happen"),
        (policy.cache.active, "a compile cache (cache.dir)", "the cache does not capture what a thread compiles"),
    ]
    for clash, setting, why in clashes:
        if clash:
            raise PolicyError(
                f"{where}, rule {deferring[0]}: rest: background and {setting} do not go together ({why}); use "
                "rest: compile (compiled at the first step) or rest: eager."
            )


def _check_background(where: str, policy: CompilePolicy) -> None:
    for index, rule in enumerate(policy.rules):
        if rule.action == "regional" and rule.rest in ("nested", "outer", "auto"):
            raise PolicyError(
                f"{where}: background: true with rest: {rule.rest} (rule {index}) is not supported: the background "
                "thread replays each region alone, and these regions run other regions inside them (nested: "
                "compiling them on a thread failed on an H100, torch 2.11; auto: it may resolve to outer); use "
                "rest: compile, or background: false."
            )
    if policy.shapes.warmup:
        raise PolicyError(
            f"{where}: background: true and shapes.warmup: true both decide when compiles happen (warm-up compiles "
            "every bucket after the first batch; background compiles while eager steps run); set one of them false."
        )


def validate_optimizer_policy(optimizer: OptimizerPolicy, where: str = "optimizer policy") -> OptimizerPolicy:
    optimizer.compile = str(optimizer.compile).lower()  # YAML's `true` arrives as the string "True"
    if optimizer.compile not in OPTIMIZER_COMPILE:
        raise PolicyError(
            f"{where}: invalid compile {optimizer.compile!r}. Valid values: {', '.join(OPTIMIZER_COMPILE)}."
        )
    if optimizer.kernel not in OPTIMIZER_KERNELS:
        raise PolicyError(
            f"{where}: invalid kernel {optimizer.kernel!r}. Valid values: {', '.join(OPTIMIZER_KERNELS)}."
        )
    check_mode(where, optimizer.mode)
    unknown = [c for c in optimizer.auto_candidates if c not in OPTIMIZER_CANDIDATES]
    if unknown or not optimizer.auto_candidates:
        raise PolicyError(
            f"{where}: invalid auto_candidates {list(optimizer.auto_candidates)}. "
            f"Give one or more of: {', '.join(OPTIMIZER_CANDIDATES)}."
        )
    if optimizer.auto_steps < 1:
        raise PolicyError(f"{where}: auto_steps must be >= 1, got {optimizer.auto_steps}.")
    if optimizer.clip_grad_norm is not None and optimizer.clip_grad_value is not None:
        raise PolicyError(f"{where}: give clip_grad_norm or clip_grad_value, not both.")
    for name in ("clip_grad_norm", "clip_grad_value"):
        value = getattr(optimizer, name)
        if value is not None and not value > 0:
            raise PolicyError(f"{where}: {name} must be > 0 (or null: no clipping), got {value}.")
    return optimizer


def shape_policy_problems(policy: CompilePolicy) -> List[str]:
    """What is wrong with ``policy.shapes``, as messages naming what is valid (empty when all is well)."""
    shapes = policy.shapes
    problems = dynamic_problems(shapes.dynamic, shapes.pad) + padding_problems(shapes.pad)
    static = [policy.dynamic is False] + [rule.dynamic is False for rule in policy.rules]
    if shapes.dynamic and any(static):
        problems.append(
            "shapes.dynamic marks dimensions dynamic, but `dynamic: false` (in the policy or a rule) makes "
            "torch.compile ignore the marks; set dynamic to null"
        )
    if shapes.strict_recompiles and not shapes.warmup:
        problems.append(
            "shapes.strict_recompiles needs shapes.warmup: true, or the first compile of a shape would fail"
        )
    if shapes.pad.enabled and not problems:
        count = shapes.pad.bucket_count
        if count is None and shapes.warmup:
            problems.append("shapes.warmup needs a finite set of buckets: give shapes.pad.max with multiple_of")
        elif count is not None and any(static) and count > policy.recompile_limit:
            problems.append(
                f"{count} buckets compile {count} static graphs per region, more than "
                f"recompile_limit ({policy.recompile_limit}); past it a region silently runs eagerly. "
                "Raise recompile_limit or use fewer buckets"
            )
    return problems
