"""The contents of a bundle, per layer: torch's mega-cache and the files of Inductor's and Triton's caches.

``mega_cache``: ``torch.compiler.save_cache_artifacts()`` (FX graphs, AOTAutograd entries, autotuning results
as torch packs them; loading it rebuilds what it lacks, e.g. the CPU's C++ libraries). ``cache_dirs``: a tar of
the files this process wrote into Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``: FX graphs,
AOTAutograd entries, generated code and compiled kernels, Triton's binaries under ``triton/``) and into
``TRITON_CACHE_DIR`` where that is set elsewhere; unpacked into this machine's directories before any compile,
never over a file that exists.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import torch

from compile_trainer import compat

SKIPPED_SUFFIXES = (".lock", ".partial", ".tmp")


def cache_roots() -> Dict[str, Path]:
    """Prefix in the tar -> the local directory it comes from and goes to."""
    roots = {"inductor": Path(compat.inductor_cache_dir())}
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton and not Path(triton).resolve().is_relative_to(roots["inductor"].resolve()):
        roots["triton"] = Path(triton)
    return roots


def _files_since(root: Path, since: float) -> Iterable[Path]:
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if name.endswith(SKIPPED_SUFFIXES) or path.is_symlink():
                continue
            try:
                if path.stat().st_mtime >= since:
                    yield path
            except FileNotFoundError:  # removed meanwhile by another process's cache
                continue


def pack_cache_dirs(since: float) -> Tuple[bytes, int]:
    """A tar of the cache files written since ``since`` (epoch seconds), and how many files it holds."""
    buffer, count = io.BytesIO(), 0
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for prefix, root in cache_roots().items():
            for path in _files_since(root, since):
                try:
                    tar.add(path, arcname=f"{prefix}/{path.relative_to(root)}", recursive=False)
                    count += 1
                except FileNotFoundError:
                    continue
    return buffer.getvalue(), count


def unpack_cache_dirs(data: bytes) -> int:
    """Write the tar's files into this machine's cache directories (not over existing ones); how many were new."""
    roots, written = cache_roots(), 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar:
            prefix, _, relative = member.name.partition("/")
            if not member.isfile() or prefix not in roots:
                continue
            root = roots[prefix].resolve()
            target = (root / relative).resolve()
            if not target.is_relative_to(root) or target.exists():
                continue  # a path leaving the cache directory, or an entry this machine has already
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            partial.write_bytes(tar.extractfile(member).read())
            partial.chmod(member.mode & 0o777)
            os.replace(partial, target)
            written += 1
    return written


def save_sections(layers: List[str], since: float) -> Tuple[Dict[str, bytes], Dict[str, int]]:
    """The bundle's sections for ``layers``, and counts that describe them."""
    sections, counts = {}, {}
    if "mega_cache" in layers:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            sections["mega_cache"] = saved[0]
            counts["mega_cache_artifacts"] = sum(len(items) for items in _artifact_lists(saved[1]))
    if "cache_dirs" in layers:
        sections["cache_dirs"], counts["cache_dir_files"] = pack_cache_dirs(since)
    return sections, counts


def _artifact_lists(info: object) -> List[list]:
    artifacts = getattr(info, "artifacts", {}) or {}
    return [items for items in artifacts.values() if isinstance(items, list)]


def load_sections(sections: Dict[str, bytes]) -> Dict[str, float]:
    """Put the sections where torch looks for them; the files written and the seconds each layer took."""
    loaded: Dict[str, float] = {}
    if "cache_dirs" in sections:
        started = time.perf_counter()
        loaded["dir_files"] = unpack_cache_dirs(sections["cache_dirs"])
        loaded["dirs_load_s"] = time.perf_counter() - started
    if "mega_cache" in sections:
        started = time.perf_counter()
        if torch.compiler.load_cache_artifacts(sections["mega_cache"]) is None:
            raise ValueError("torch could not read the mega-cache section (torch.compiler logged why)")
        loaded["mega_cache_load_s"] = time.perf_counter() - started
    return loaded
