"""Dynamo's process-wide settings: the recompile limit, compiler collectives, the DDP optimizer, ignored loggers."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .dynamo_events import compilation_metrics
from .dynamo_texts import is_recompile_limit
from .entry import CountingBackend, Entry, Obsolete, double, fresh

__all__ = [
    "ENTRIES",
    "LoggerMethodName",
    "compiler_collectives",
    "dynamo_config_loggable",
    "ignored_logger_methods",
    "recompile_limit",
    "set_compiler_collectives",
    "set_ignored_logger_methods",
    "set_optimize_ddp",
    "set_recompile_limit",
    "turn_off_ddp_optimizer",
]


def recompile_limit() -> int:
    return torch._dynamo.config.recompile_limit


def set_recompile_limit(limit: int) -> int:
    """Set Dynamo's process-wide recompile limit; returns the previous one (to restore it with)."""
    previous = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = limit
    return previous


# enable_compiler_collectives: ranks exchange Dynamo's size observations at each compile so that every rank makes
# the same dynamic/static decision.


def compiler_collectives() -> bool:
    return bool(torch._dynamo.config.enable_compiler_collectives)


def set_compiler_collectives(enabled: bool) -> bool:
    """Turn Dynamo's compiler collectives on or off; returns the previous value."""
    previous = compiler_collectives()
    torch._dynamo.config.enable_compiler_collectives = enabled
    return previous


# optimize_ddp: True or "ddp_optimizer" splits each graph compiled inside DDP's forward at the bucket boundaries
# (DDPOptimizer; convert_frame asks DistributedDataParallel._get_active_ddp_module()), False or "no_optimization"
# leaves graphs whole; other strings are compiled-autograd modes ("python_reducer"), left as set.


def _ddp_optimizer_on() -> bool:
    return torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"


def turn_off_ddp_optimizer() -> Any:
    """Turn Dynamo's DDPOptimizer off where it is on; returns the previous ``optimize_ddp`` (to restore it with)."""
    previous = torch._dynamo.config.optimize_ddp
    if _ddp_optimizer_on():
        torch._dynamo.config.optimize_ddp = False
    return previous


def set_optimize_ddp(value: Any) -> None:
    torch._dynamo.config.optimize_ddp = value


def ignored_logger_methods() -> set:
    return set(torch._dynamo.config.ignore_logger_methods)


def set_ignored_logger_methods(methods: set) -> set:
    """Logger methods Dynamo drops while tracing instead of breaking the graph (``ignore_logger_methods``, 2.6+;
    an alias of ``ignore_logging_functions`` from 2.12); returns the previous set, to restore it with.

    Torch up to 2.11 writes this set into every compile's metrics as JSON, and a function is not JSON: each compile
    then logs "Unexpected exception logging compilation metrics" and its metrics are lost (seen on 2.11: no
    recompile reasons, no compile times). There, each method goes in as a ``LoggerMethodName``, which Dynamo's
    membership test still matches and JSON writes as its name; ``dynamo_config_loggable`` checks the result.
    """
    previous = ignored_logger_methods()
    torch._dynamo.config.ignore_logger_methods = set(methods)
    if not dynamo_config_loggable():
        torch._dynamo.config.ignore_logger_methods = {LoggerMethodName.of(method) for method in methods}
    return previous


class LoggerMethodName(str):
    """A logger method in Dynamo's ignore set that equals (and hashes as) the method, and is JSON as its name."""

    method: Callable[..., Any]

    @classmethod
    def of(cls, method: Callable[..., Any]) -> Any:
        if isinstance(method, cls):
            return method
        name = cls(f"{getattr(method, '__module__', '')}.{getattr(method, '__qualname__', repr(method))}")
        name.method = method
        return name

    def __eq__(self, other: object) -> bool:
        return other is self.method or (isinstance(other, LoggerMethodName) and other.method is self.method)

    def __ne__(self, other: object) -> bool:  # str's own would compare the name
        return not self == other

    def __hash__(self) -> int:
        return hash(self.method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


def dynamo_config_loggable() -> bool:
    """Whether Dynamo can write its config into a compile's metrics (``_get_dynamo_config_for_logging``); True where
    torch has no such function."""
    config_for_logging = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    if config_for_logging is None:
        return True
    try:
        config_for_logging()
    except (TypeError, ValueError):
        return False
    return True


# -- The probes --------------------------------------------------------------------------------------------

_probe_log = logging.getLogger("compile_trainer.compat.probe")


def _double_and_log(x: torch.Tensor) -> torch.Tensor:
    _probe_log.warning("traced")
    return x * 2


def _probe_recompile_limit() -> None:
    """The limit is Dynamo's setting, and a frame past it is reported with a text ``is_recompile_limit`` knows."""
    assert isinstance(recompile_limit(), int) and recompile_limit() >= 1
    previous = set_recompile_limit(1)
    try:
        assert recompile_limit() == 1 == torch._dynamo.config.recompile_limit
        backend = CountingBackend()
        compiled = torch.compile(fresh(double), backend=backend, dynamic=False)
        compiled(torch.ones(2))
        compiled(torch.ones(3))  # over the limit: runs eagerly, not compiled
        assert backend.graphs == 1
        failed = list(compilation_metrics())[-1]
        assert failed.fail_type and is_recompile_limit(str(failed.fail_reason)), failed.fail_reason
    finally:
        assert set_recompile_limit(previous) == 1
    assert recompile_limit() == previous


def _probe_compiler_collectives() -> None:
    previous = set_compiler_collectives(True)
    try:
        assert compiler_collectives() is True and torch._dynamo.config.enable_compiler_collectives is True
    finally:
        assert set_compiler_collectives(previous) is True
    assert compiler_collectives() is previous


def _probe_ddp_optimizer() -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert DistributedDataParallel._get_active_ddp_module() is None
    previous = torch._dynamo.config.optimize_ddp
    try:
        set_optimize_ddp(True)
        assert _ddp_optimizer_on() is True
        assert turn_off_ddp_optimizer() is True and _ddp_optimizer_on() is False
        set_optimize_ddp("python_reducer")
        assert turn_off_ddp_optimizer() == "python_reducer" and torch._dynamo.config.optimize_ddp == "python_reducer"
    finally:
        set_optimize_ddp(previous)


def _probe_ignored_logger_methods() -> None:
    """A logger method in the set is dropped from traced code (no graph break), and Dynamo can still log its config."""
    previous = set_ignored_logger_methods(ignored_logger_methods() | {logging.Logger.warning})
    try:
        assert logging.Logger.warning in ignored_logger_methods()
        assert dynamo_config_loggable(), "the ignore set breaks every compile's metrics"
        compiled = torch.compile(fresh(_double_and_log), backend="eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        set_ignored_logger_methods(previous)
    assert ignored_logger_methods() == previous


ENTRIES = [
    Entry(
        "recompile_limit",
        _probe_recompile_limit,
        reaches=("torch._dynamo.config.recompile_limit",),
        checked=("2.9.1", "2.13"),
        upstream=("https://github.com/pytorch/pytorch/pull/143709",),
        obsolete=(
            Obsolete(
                (2, 10),
                "'recompile_limit' and 'cache_size_limit' in dynamo_texts._RECOMPILE_LIMIT_TEXTS (the fail_reason "
                "texts of torch 2.9 and before; 2.10+ says 'recompile limit')",
            ),
        ),
    ),
    Entry(
        "set_compiler_collectives",
        _probe_compiler_collectives,
        reaches=("torch._dynamo.config.enable_compiler_collectives",),
        checked=("2.13 CPU, 2 gloo processes",),
    ),
    Entry(
        "turn_off_ddp_optimizer",
        _probe_ddp_optimizer,
        reaches=(
            "torch._dynamo.config.optimize_ddp",
            "torch._dynamo.utils.get_optimize_ddp_mode",
            "torch.nn.parallel.DistributedDataParallel._get_active_ddp_module",
        ),
        checked=("2.9.1", "2.13"),
    ),
    Entry(
        "set_ignored_logger_methods",
        _probe_ignored_logger_methods,
        reaches=("torch._dynamo.config.ignore_logger_methods", "torch._dynamo.utils._get_dynamo_config_for_logging"),
        checked=("2.9.1", "2.11 H100", "2.13"),
        upstream=(
            "https://github.com/pytorch/pytorch/pull/168898",
            "https://github.com/pytorch/pytorch/pull/178506",
        ),
        obsolete=(
            Obsolete(
                (2, 12),
                "LoggerMethodName, dynamo_config_loggable and their fallback in set_ignored_logger_methods (torch up "
                "to 2.11 wrote the ignore set into each compile's metrics as JSON), and "
                "tests/test_compat.py::test_an_ignored_logger_method_by_name_is_json_and_still_ignored_by_dynamo",
            ),
        ),
    ),
]
