"""Every private torch API the library reaches, probed on the installed torch (``compile_trainer.compat``).

A torch upgrade that moves or changes one of them fails here first, with the entry's name."""

import ast
from pathlib import Path

import pytest
import torch

from compile_trainer import compat

PACKAGE = Path(compat.__file__).resolve().parent


@pytest.mark.parametrize("entry", compat.ENTRIES, ids=lambda entry: entry.name)
def test_each_private_torch_api_works_on_this_torch(entry):
    entry.probe()


@pytest.mark.parametrize("entry, version", compat.VERSIONED_ENTRIES, ids=lambda item: getattr(item, "name", ""))
def test_versioned_entries_exist_from_their_version(entry, version):
    if compat.torch_version() < version:
        assert compat.needs_torch(entry.name, version) is not None
        with pytest.raises((AttributeError, ImportError, RuntimeError)):
            entry.probe()
    else:
        entry.probe()


def _private_torch_names(path: Path):
    """``torch._x`` attribute chains and private-module imports in one source file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch":
                yield f"torch...{node.attr} (line {node.lineno})"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            private = [part for part in node.module.split(".") if part.startswith("_")]
            private += [alias.name for alias in node.names if alias.name.startswith("_")]
            if private:
                yield f"from {node.module} import ... (line {node.lineno})"


def test_private_torch_apis_are_reached_only_through_compat():
    offenders = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "compat.py" and (names := list(_private_torch_names(path)))
    }
    # Allowed: the pytree helpers (torch.utils._pytree) and the `torch._foreach_*` ops, ATen operators that
    # torch.optim itself calls; neither is compiler internals.
    allowed = ("from torch.utils._pytree import ...", "torch..._foreach_")
    offenders = {path: [n for n in names if not n.startswith(allowed)] for path, names in offenders.items()}
    assert not {path: names for path, names in offenders.items() if names}


def test_the_recompile_limit_a_policy_sets_is_restored_when_it_is_removed(tiny_gpt):
    from compile_trainer import apply_policy, to_policy

    before = torch._dynamo.config.recompile_limit
    applied = apply_policy(tiny_gpt, to_policy("regional", backend="eager", recompile_limit=before + 5))
    assert torch._dynamo.config.recompile_limit == before + 5
    applied.remove()
    assert torch._dynamo.config.recompile_limit == before


def test_an_ignored_logger_method_by_name_is_json_and_still_ignored_by_dynamo():
    """Torch up to 2.11 writes the ignore set into each compile's metrics as JSON (a function there loses every
    compile's metrics); the name stand-in is JSON and Dynamo still drops the call without a graph break."""
    import json
    import logging

    log = logging.getLogger("compile_trainer.test_compat")
    name = compat.LoggerMethodName.of(logging.Logger.warning)
    assert logging.Logger.warning in {name} and json.dumps(sorted({name})) == '["logging.Logger.warning"]'
    with pytest.raises(TypeError):
        json.dumps(sorted({logging.Logger.warning}))  # what torch <= 2.11 did with the function itself

    def noisy(x):
        log.warning("traced")
        return x + 1

    previous = torch._dynamo.config.ignore_logger_methods
    torch._dynamo.config.ignore_logger_methods = {name}
    try:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(noisy, backend="eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        torch._dynamo.config.ignore_logger_methods = previous
        torch._dynamo.reset()
    assert compat.dynamo_config_loggable()
