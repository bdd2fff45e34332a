"""The bundle file: a JSON manifest and named binary sections, each with its SHA-256.

Layout: ``MAGIC``, the manifest's length (8 bytes, big-endian), the manifest (UTF-8 JSON), then the sections'
bytes in the manifest's order. The manifest holds the key and what it was computed from, the date, the regions,
the cold compile's seconds and each section's name, size and checksum, so a truncated, corrupt or foreign file is
recognised before anything in it is used. Needs neither torch nor fsspec.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict

MAGIC = b"compile_trainer bundle 1\n"
LENGTH_BYTES = 8
SUFFIX = ".ctbundle"


class CompileCacheWarning(UserWarning):
    """A bundle could not be used or written; the run compiles cold (or keeps no bundle) and goes on."""


class BundleError(ValueError):
    """A bundle that cannot be used; the message says why (truncated, corrupt, not a bundle)."""


@dataclass
class Bundle:
    manifest: Dict[str, Any]
    sections: Dict[str, bytes]

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.sections.values())


def encode(manifest: Dict[str, Any], sections: Dict[str, bytes]) -> bytes:
    listed = [
        {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in sections.items()
    ]
    header = json.dumps({**manifest, "sections": listed}, sort_keys=True).encode()
    return b"".join([MAGIC, len(header).to_bytes(LENGTH_BYTES, "big"), header, *sections.values()])


def header_length(data: bytes) -> int:
    """Bytes from the start up to the end of the manifest (``data`` must hold at least the length field)."""
    if not data.startswith(MAGIC):
        raise BundleError("not a compile_trainer bundle (its first bytes are not the bundle's magic)")
    start = len(MAGIC)
    if len(data) < start + LENGTH_BYTES:
        raise BundleError("truncated: the file ends inside its header")
    return start + LENGTH_BYTES + int.from_bytes(data[start : start + LENGTH_BYTES], "big")


def decode_manifest(data: bytes) -> Dict[str, Any]:
    """The manifest of a bundle from its first bytes (at least ``header_length``)."""
    end = header_length(data)
    if len(data) < end:
        raise BundleError("truncated: the file ends inside its manifest")
    try:
        manifest = json.loads(data[len(MAGIC) + LENGTH_BYTES : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BundleError(f"corrupt manifest ({error})") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sections"), list):
        raise BundleError("corrupt manifest (no list of sections)")
    return manifest


def decode(data: bytes) -> Bundle:
    """The whole bundle, every section checked against its size and SHA-256."""
    manifest = decode_manifest(data)
    offset, sections = header_length(data), {}
    for section in manifest["sections"]:
        chunk = data[offset : offset + section["size"]]
        if len(chunk) != section["size"]:
            raise BundleError(f"truncated: section {section['name']!r} has {len(chunk)} of {section['size']} bytes")
        if hashlib.sha256(chunk).hexdigest() != section["sha256"]:
            raise BundleError(f"corrupt: section {section['name']!r} does not match its checksum")
        sections[section["name"]] = chunk
        offset += section["size"]
    if offset != len(data):
        raise BundleError(f"corrupt: {len(data) - offset} bytes after the last section")
    return Bundle(manifest, sections)
