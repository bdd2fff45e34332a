"""``compile-trainer cache``: list the bundles of a cache directory or URL, inspect one, prune old ones."""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List, Optional

from compile_trainer.cache.bundle import SUFFIX, BundleError, decode, decode_manifest, header_length
from compile_trainer.cache.storage import BundleStore, StoredBundle
from compile_trainer.tables import text_table

HEAD_BYTES = 64 * 1024  # enough for a manifest; a longer one is read again whole


class CacheCommandError(ValueError):
    """A cache directory or bundle that the command cannot read; the message says which and why."""


def read_manifest(store: BundleStore, name: str) -> Dict[str, Any]:
    head = store.read(name, HEAD_BYTES)
    if head is None:
        raise CacheCommandError(f"no bundle {name} in {store.location}")
    if len(head) == HEAD_BYTES and header_length(head) > HEAD_BYTES:
        head = store.read(name)
    return decode_manifest(head)


def _date(stored: StoredBundle) -> str:
    return datetime.datetime.fromtimestamp(stored.modified, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def list_bundles(location: str) -> str:
    store = BundleStore(location)
    rows: List[List[str]] = []
    for stored in store.list(SUFFIX):
        try:
            manifest = read_manifest(store, stored.name)
        except BundleError as error:
            rows.append(
                [stored.name[: -len(SUFFIX)], f"{stored.size / 1e6:.1f}", _date(stored), f"unreadable: {error}"]
            )
            continue
        fields = manifest.get("fields", {})
        rows.append(
            [
                stored.name[: -len(SUFFIX)],
                f"{stored.size / 1e6:.1f}",
                _date(stored),
                f"torch {fields.get('torch')}, {fields.get('device')}, {len(manifest.get('regions', []))} regions, "
                f"cold compile {_seconds(manifest.get('cold_compile_s'))} s",
            ]
        )
    if not rows:
        return f"no bundles in {location}"
    return "\n".join([f"{len(rows)} bundle(s) in {location}", *text_table(["key", "MB", "written (UTC)", "for"], rows)])


def _name(key: str) -> str:
    return key if key.endswith(SUFFIX) else f"{key}{SUFFIX}"


def inspect_bundle(location: str, key: str) -> str:
    """Everything a bundle's manifest says, and whether its sections match their checksums."""
    store = BundleStore(location)
    data = store.read(_name(key))
    if data is None:
        raise CacheCommandError(f"no bundle {_name(key)} in {location} (`compile-trainer cache list {location}`)")
    try:
        manifest = decode_manifest(data)
    except BundleError as error:
        return f"bundle {_name(key)}: unreadable ({error})"
    try:
        decode(data)
        integrity = "every section matches its checksum"
    except BundleError as error:
        integrity = f"DAMAGED: {error}"
    fields = manifest.get("fields", {})
    lines = [
        f"bundle {_name(key)} in {location}",
        f"  key           {manifest.get('key')}",
        f"  size          {len(data) / 1e6:.2f} MB ({integrity})",
        f"  written       {manifest.get('date')}",
        f"  versions      torch {fields.get('torch')}, triton {fields.get('triton')}, cuda {fields.get('cuda')}",
        f"  device        {fields.get('device')}",
        f"  model         {fields.get('model')}",
        f"  salt          {fields.get('salt')!r}",
        f"  cold compile  {_seconds(manifest.get('cold_compile_s'))} s",
        f"  regions       {', '.join(manifest.get('regions', [])) or '-'}",
        "  sections      " + ", ".join(f"{s['name']} {s['size'] / 1e6:.2f} MB" for s in manifest.get("sections", [])),
    ]
    lines += [f"  {name:<13} {count}" for name, count in manifest.get("counts", {}).items()]
    return "\n".join(lines)


def prune_bundles(location: str, older_than_days: Optional[float], keep: Optional[int], dry_run: bool) -> str:
    """Delete bundles written more than ``older_than_days`` ago and all but the newest ``keep``."""
    if older_than_days is None and keep is None:
        raise CacheCommandError("say what to prune: --older-than DAYS and/or --keep N")
    store = BundleStore(location)
    bundles = store.list(SUFFIX)  # newest first
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    doomed = [
        stored
        for index, stored in enumerate(bundles)
        if (cutoff is not None and stored.modified < cutoff) or (keep is not None and index >= keep)
    ]
    for stored in doomed if not dry_run else []:
        store.delete(stored.name)
    verb = "would delete" if dry_run else "deleted"
    names = "".join(f"\n  {stored.name}" for stored in doomed)
    return f"{verb} {len(doomed)} of {len(bundles)} bundle(s) in {location}{names}"
