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
