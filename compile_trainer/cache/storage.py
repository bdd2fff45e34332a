"""Where bundles live: a local directory (plain file IO) or any fsspec URL (imported only for URLs).

Writes are atomic: a local or shared-filesystem write goes to a temporary name in the same directory and is
renamed over the bundle; an object store's put replaces the object whole. A reader never sees half a bundle.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from compile_trainer.schema.cache import url_protocol

# Object stores: a put is atomic per object, and a rename is a copy (not atomic), so write in place.
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


@dataclass
class StoredBundle:
    name: str
    size: int
    modified: float  # seconds since the epoch


class BundleStore:
    """The bundles of one cache directory, by file name."""

    def __init__(self, location: str):
        self.location = str(location).rstrip("/")
        self.local = None if url_protocol(self.location) else Path(self.location.removeprefix("file://"))
        self.fs: Any = None
        self.root = self.location
        if self.local is None:
            try:
                import fsspec
            except ImportError as error:
                raise RuntimeError(
                    f"cache.dir={self.location!r} is a URL, which needs fsspec (pip install fsspec, and s3fs for "
                    "s3://, gcsfs for gs://); a local directory needs neither"
                ) from error
            self.fs, self.root = fsspec.core.url_to_fs(self.location)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read(self, name: str, length: Optional[int] = None) -> Optional[bytes]:
        """The bundle's bytes (the first ``length`` only, if given), or ``None`` when there is none."""
        try:
            if self.local is not None:
                with open(self.local / name, "rb") as file:
                    return file.read(length) if length is not None else file.read()
            with self.fs.open(self._path(name), "rb") as file:
                return file.read(length) if length is not None else file.read()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=self.local)
            try:
                with os.fdopen(handle, "wb") as file:
                    file.write(data)
                os.replace(temporary, self.local / name)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            return
        self.fs.makedirs(self.root, exist_ok=True)
        if set(_protocols(self.fs)) & set(OBJECT_STORES):
            self.fs.pipe_file(self._path(name), data)
            return
        temporary = self._path(f".{name}.{uuid.uuid4().hex}.partial")
        self.fs.pipe_file(temporary, data)
        self.fs.mv(temporary, self._path(name))

    def list(self, suffix: str) -> List[StoredBundle]:
        """The bundles here (names ending in ``suffix``), newest first."""
        found = []
        if self.local is not None:
            if not self.local.is_dir():
                return []
            for path in self.local.glob(f"*{suffix}"):
                stat = path.stat()
                found.append(StoredBundle(path.name, stat.st_size, stat.st_mtime))
        else:
            if not self.fs.exists(self.root):
                return []
            self.fs.invalidate_cache(self.root)
            for info in self.fs.ls(self.root, detail=True):
                name = info["name"].rstrip("/").rsplit("/", 1)[-1]
                if name.endswith(suffix) and not name.startswith("."):
                    found.append(StoredBundle(name, int(info.get("size") or 0), _modified(info)))
        return sorted(found, key=lambda bundle: bundle.modified, reverse=True)

    def delete(self, name: str) -> None:
        if self.local is not None:
            (self.local / name).unlink(missing_ok=True)
        else:
            self.fs.rm(self._path(name))


def _protocols(fs: Any) -> tuple:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _modified(info: dict) -> float:
    """An fsspec listing's modification time (``LastModified`` on S3, ``mtime`` elsewhere), in epoch seconds."""
    value = info.get("LastModified", info.get("mtime", info.get("updated")))
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return float(value) if isinstance(value, (int, float)) else time.time()
