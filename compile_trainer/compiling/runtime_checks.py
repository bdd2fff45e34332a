"""Checks of a policy against the installed torch, run where the policy is applied (before training).

The schema's own checks (``compile_trainer.schema.validate``) need nothing but the policy; these need torch:
which backends exist, whether background compilation and nested regions are available.
"""

from __future__ import annotations

from typing import Optional

from compile_trainer import compat
from compile_trainer.schema import CompilePolicy, PolicyError


def check_backend(where: str, backend: Optional[str]) -> None:
    if backend is not None and backend not in compat.list_backends():
        valid = ", ".join(compat.list_backends())
        raise PolicyError(f"{where}: unknown backend {backend!r}. Valid backends: {valid}.")


def background_compile_problem() -> Optional[str]:
    """Why background compilation cannot work with this torch, or None."""
    return compat.eager_backward_lowering_problem()


def check_policy_runtime(policy: CompilePolicy) -> CompilePolicy:
    """Raise ``PolicyError`` for what the installed torch cannot do of ``policy``; returns it."""
    where = f"compile policy {policy.name!r}"
    check_backend(where, policy.backend)
    for index, rule in enumerate(policy.rules):
        check_backend(f"{where}, rule {index} {rule.describe()}", rule.backend)
    check_backend(f"{where}, optimizer", policy.optimizer.backend)
    if policy.background and policy.compiles_modules:
        problem = background_compile_problem()
        if problem:
            raise PolicyError(f"{where}: background: true {problem}.")
    nested = [i for i, rule in enumerate(policy.rules) if rule.action == "regional" and rule.rest == "nested"]
    if nested and policy.enabled and not compat.has_nested_compile_region():
        problem = compat.needs_torch("rest: nested (torch.compiler.nested_compile_region)", (2, 8))
        raise PolicyError(f"{where}, rule {nested[0]}: {problem}.")
    return policy
