"""Checks of a policy against the installed torch, run where the policy is applied (before training).

The schema's own checks (``compile_trainer.schema.validate``) need nothing but the policy; these need torch:
which backends exist, whether background compilation is available, whether the compile
cache's URL can be reached with the installed packages.
"""

from __future__ import annotations

import re
from typing import List, Optional

import torch

from compile_trainer import compat
from compile_trainer.schema import CompilePolicy, PolicyError
from compile_trainer.schema.cache import url_protocol
from compile_trainer.schema.keys import did_you_mean

# Backends torch registers for its own tests and tools, left out of the backends an error offers (still accepted):
# relu_compile_error_TESTING_ONLY, dynamo_minifier_backend, eager_debug, ... (torch's tags cannot tell them apart:
# it tags eager and aot_eager "debug" too).
TORCH_INTERNAL_BACKEND = re.compile("testing|minifier|debug", re.IGNORECASE)


def offered_backends() -> List[str]:
    """The backends an error names as valid: every registered one but torch's test and debugging tools."""
    return [name for name in registered_backends() if not TORCH_INTERNAL_BACKEND.search(name)]


def registered_backends() -> List[str]:
    return sorted(torch.compiler.list_backends(exclude_tags=()))


def check_backend(where: str, backend: Optional[str]) -> None:
    if backend is not None and backend not in registered_backends():
        offered = offered_backends()
        raise PolicyError(
            f"{where}: unknown backend {backend!r}{did_you_mean(backend, offered)}. Valid backends: "
            f"{', '.join(offered)}."
        )


def background_compile_problem(lowering: str = "thread") -> Optional[str]:
    """Why background compilation (its graphs lowered in ``lowering``) cannot work with this torch, or None."""
    problem = compat.eager_backward_lowering_problem()
    if problem is None and lowering == "subprocess":
        problem = compat.subprocess_lowering_problem()
        if problem:
            problem = f"with background_lowering: subprocess {problem}; use background_lowering: thread"
    return problem


def cache_storage_problem(location: str) -> Optional[str]:
    """Why the installed packages cannot reach the cache URL ``location`` (fsspec and its protocol's), or None."""
    protocol = url_protocol(location)
    if protocol is None:
        return None
    try:
        import fsspec

        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as error:
        return (
            f"cache.dir={location!r} needs fsspec with {protocol}:// support ({type(error).__name__}: {error}); "
            "pip install 'compile_trainer[remote-cache]' gives fsspec and s3fs (gcsfs for gs://); a local "
            "directory needs neither"
        )
    return None


def check_policy_runtime(policy: CompilePolicy) -> CompilePolicy:
    """Raise ``PolicyError`` for what the installed torch cannot do of ``policy``; returns it."""
    where = policy.label
    check_backend(where, policy.backend)
    for index, rule in enumerate(policy.rules):
        check_backend(f"{where}, rule {index} {rule.describe()}", rule.backend)
    check_backend(f"{where}, optimizer", policy.optimizer.backend)
    deferring = policy.regional_rules_with_rest("background")
    if (policy.background or deferring) and policy.compiles_modules:
        problem = background_compile_problem(policy.lowering)
        if problem:
            setting = "background: true" if policy.background else f"rule {deferring[0]}: rest: background"
            raise PolicyError(f"{where}: {setting} {problem}.")
    if policy.cache.active:
        problem = cache_storage_problem(str(policy.cache.dir))
        if problem:
            raise PolicyError(f"{where}: {problem}.")
    return policy


COMPILER_COLLECTIVES_NEED_ACCELERATOR = (
    "distributed.consistent_dynamic_shapes (Dynamo's compiler collectives) needs an accelerator: torch's "
    "run_compiler_collective expects one device type in the process group (a gloo group lists cpu and cuda) and "
    "picks the device rank % torch.accelerator.device_count() (0 devices here); turn it off on the CPU "
    "(checked torch 2.13)"
)


def check_distributed_runtime(policy: CompilePolicy) -> None:
    """Checks that need the installed torch, run when training is distributed."""
    if policy.enabled and policy.distributed.consistent_dynamic_shapes:
        if torch.accelerator.device_count() == 0:
            raise PolicyError(COMPILER_COLLECTIVES_NEED_ACCELERATOR)
