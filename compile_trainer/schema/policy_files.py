"""Policy files: YAML files of a policy's fields, named by a bundled policy's name or given by their path.

A policy file is what Hydra composes from a ``compile`` group (``conf/compile/regional.yaml``): the policy's fields
and a ``defaults`` list. Read without Hydra (``to_policy("configs/compile/my_policy.yaml")``), the list's names other
than ``schema`` and ``_self_`` are policies the file builds on (``dynamic_full`` on ``dynamic``), looked for beside
the file, then among the bundled ones, and merged under its own keys (lists are replaced, not appended); its other
entries (a recipe's override) concern Hydra alone.

A string is a path when it ends in ``.yaml`` or ``.yml`` or holds a path separator, else the name of a bundled
policy: a name never reads a file of the working directory, so ``CompileCallback("regional")`` means the same
wherever it runs, and the error for an unknown name points to a file of that name where a project keeps its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from compile_trainer.schema.keys import did_you_mean, unknown_keys
from compile_trainer.schema.policy import CompilePolicy
from compile_trainer.schema.validate import PolicyError

POLICY_FILE_SUFFIXES = (".yaml", ".yml")
# The defaults-list entries that only Hydra reads: the schema every file is typed by, and the file's own place.
HYDRA_ONLY_DEFAULTS = ("schema", "_self_")
# Where projects keep their policy files (this repository's layout, the lightning-hydra-template's): an unknown
# name that is a file in one of these (relative to the working directory) is named in the error, with its path.
PROJECT_POLICY_DIRS = ("conf/compile", "configs/compile", ".")


def is_policy_path(spec: str) -> bool:
    """Whether the string ``spec`` is a policy file's path rather than a bundled policy's name."""
    return spec.endswith(POLICY_FILE_SUFFIXES) or "/" in spec or os.sep in spec


def policy_names(directory: Path) -> List[str]:
    return sorted(p.stem for p in directory.iterdir() if p.suffix in POLICY_FILE_SUFFIXES) if directory.is_dir() else []


def unknown_name_message(name: str, bundled: Sequence[str]) -> str:
    """What ``to_policy(name)`` looked for, with the nearest bundled name and a project's own file of that name."""
    what = "the schema that policy files build on (their defaults list), not a policy; " if name == "schema" else ""
    message = (
        f"unknown compile policy {name!r}{did_you_mean(name, bundled)}: {what}a name is a bundled policy "
        f"({', '.join(bundled)}); a policy file of your own is given by its path (ending in .yaml)"
    )
    own = [Path(d) / f"{name}{suffix}" for d in PROJECT_POLICY_DIRS for suffix in POLICY_FILE_SUFFIXES]
    found = next((str(path) for path in own if path.is_file()), None)
    return message + (f", such as {found!r}." if found else ".")


def find_policy_file(spec: str | os.PathLike[str]) -> Path:
    """The file ``spec`` names (absolute, or relative to the working directory); an error says where it looked."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    looked = path if path.is_absolute() else Path.cwd() / path
    near = did_you_mean(path.name, [f"{name}.yaml" for name in policy_names(looked.parent)])
    where = "" if looked.parent.is_dir() else f"; there is no directory {str(looked.parent)!r}"
    raise PolicyError(f"compile policy file {str(spec)!r} not found: looked for {str(looked)!r}{near}{where}.")


def read_policy_file(path: Path, bundled_dir: Path, including: Tuple[Path, ...] = ()) -> Any:
    """``path``'s fields (a ``DictConfig``) over those of the policies its defaults list builds on; ``name``
    defaults to the file's stem."""
    from omegaconf import DictConfig, OmegaConf

    name = path.stem
    if path.resolve() in including:
        chain = " -> ".join(p.stem for p in (*including, path.resolve()))
        raise PolicyError(f"compile policy {name!r} includes itself: {chain}.")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # the YAML parser's own errors (a schema module does not import it to name them)
        raise PolicyError(f"compile policy {name!r} ({path}) is not valid YAML: {error}") from error
    if not isinstance(loaded, DictConfig):
        raise PolicyError(f"compile policy {name!r} ({path}): a policy file holds a mapping of fields, not a list.")
    defaults = loaded.pop("defaults", None)
    unknown = unknown_keys(OmegaConf.to_container(loaded), CompilePolicy)
    if unknown:
        raise PolicyError(f"compile policy {name!r} ({path}): {'; '.join(unknown)}.")
    where = f"compile policy {name!r} ({path})"
    bases = merge_bases(defaults, [path.parent, bundled_dir], bundled_dir, where, (*including, path.resolve()))
    merged = OmegaConf.merge(bases, loaded)
    merged.name = loaded.get("name", name)
    return merged


def merge_bases(
    defaults: Any, directories: Sequence[Path], bundled_dir: Path, where: str, including: Tuple[Path, ...] = ()
) -> Any:
    """The policies a ``defaults`` list builds on, merged in order (a ``DictConfig``; empty for none): each name
    looked for in ``directories`` in order."""
    from omegaconf import OmegaConf

    merged = OmegaConf.create()
    for base in [entry for entry in defaults or [] if isinstance(entry, str) and entry not in HYDRA_ONLY_DEFAULTS]:
        found = _first_file(base, directories)
        if found is None:
            near = did_you_mean(base, sorted({n for d in directories for n in policy_names(d)}))
            looked = ", ".join(str(d) for d in dict.fromkeys(directories))
            raise PolicyError(f"{where}: its defaults list names {base!r}{near}, which is no policy file in {looked}.")
        merged = OmegaConf.merge(merged, read_policy_file(found, bundled_dir, including))
    return merged


def _first_file(name: str, directories: Sequence[Path]) -> Optional[Path]:
    candidates = (d / f"{name}{suffix}" for d in directories for suffix in POLICY_FILE_SUFFIXES)
    return next((path for path in candidates if path.is_file()), None)
