"""The ``cache`` section: where compiled artifacts are kept between runs and machines, and its pure checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

CACHE_MODES = ("read-write", "read-only", "off")
# What a bundle carries: the mega-cache (``torch.compiler.save_cache_artifacts``), the files this run wrote
# into Inductor's and Triton's cache directories (FX graphs, AOTAutograd entries, compiled kernels), and each
# region's Dynamo trace with its compiled code (``precompiled``: torch >= 2.11; cache/precompiled.py).
CACHE_LAYERS = ("mega_cache", "cache_dirs", "precompiled")


@dataclass
class CacheSettings:
    """A compile cache that travels: one bundle per key, loaded before the first compile, saved after warm-up.

    ``dir``: a local directory or an fsspec URL (``s3://bucket/prefix``, ``gs://...``, a shared filesystem);
    ``None`` turns the cache off. ``mode``: ``read-write``, ``read-only`` (never writes), ``off``. ``salt``:
    any text, part of the key (change it to start over). ``layers``: what a bundle carries.
    """

    dir: Optional[str] = None
    mode: str = "read-write"
    salt: str = ""
    layers: List[str] = field(default_factory=lambda: list(CACHE_LAYERS))

    @property
    def active(self) -> bool:
        return self.dir is not None and self.mode != "off"

    @property
    def writes(self) -> bool:
        return self.active and self.mode == "read-write"


def url_protocol(location: str) -> Optional[str]:
    """The fsspec protocol of a URL (``s3`` for ``s3://bucket/x``); ``None`` for a local path (``file://`` too)."""
    if "://" not in location:
        return None
    protocol = location.split("://", 1)[0]
    return None if protocol == "file" else protocol


def cache_settings_problems(settings: CacheSettings) -> List[str]:
    """What is wrong with ``settings``, as messages naming what is valid (empty when all is well)."""
    problems = []
    if settings.mode not in CACHE_MODES:
        problems.append(f"cache.mode={settings.mode!r} is invalid. Valid modes: {', '.join(CACHE_MODES)}")
    unknown = [layer for layer in settings.layers if layer not in CACHE_LAYERS]
    if unknown or not settings.layers:
        problems.append(
            f"cache.layers={list(settings.layers)} is invalid. Give one or more of: {', '.join(CACHE_LAYERS)}"
        )
    if settings.dir is not None and not str(settings.dir).strip():
        problems.append("cache.dir is empty: give a directory or an fsspec URL (s3://bucket/prefix), or null")
    return problems
