"""Read back what a W&B offline run recorded, from its ``run-*.wandb`` file.

The file is a leveldb-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks
of records, each with a 7-byte header (crc32 4, length 2, type 1) and a chunk of a serialized
``wandb_internal_pb2.Record``. wandb ships no Python reader for it.

``wandb.finish()`` can return before its service has flushed the file's last block (wandb 0.31 writes
it in 32 KiB pieces), so a reader in the same process waits for the run's ``exit`` record.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_record_bytes(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    offset, pending = HEADER_SIZE, b""
    while offset + HEADER_SIZE <= len(data):
        space = BLOCK_SIZE - offset % BLOCK_SIZE
        if space < HEADER_SIZE:  # the block's tail is zero padding
            offset += space
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER_SIZE])
        if kind == 0 and length == 0:
            offset += space
            continue
        if offset + HEADER_SIZE + length > len(data):  # a record still being written
            return
        chunk = data[offset + HEADER_SIZE : offset + HEADER_SIZE + length]
        offset += HEADER_SIZE + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    """History rows, summary and config of one offline run."""

    history: List[Dict[str, Any]] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)
    group: str = ""
    name: str = ""
    files_dir: Optional[Path] = None
    finished: bool = False  # the file holds the run's ``exit`` record

    def series(self, key: str) -> List[Any]:
        return [row[key] for row in self.history if key in row]

    def table(self, key: str) -> Dict[str, Any]:
        """The last ``wandb.Table`` logged under ``key``, as ``{"columns": [...], "data": [[...], ...]}``."""
        paths = [row[f"{key}/path"] for row in self.history if row.get(f"{key}/_type") == "table-file"]
        if not paths or self.files_dir is None:
            raise KeyError(f"no table logged under {key!r}")
        return json.loads((self.files_dir / paths[-1]).read_text())


def read_offline_run(path: Union[str, Path], wait_s: float = 30.0) -> OfflineRun:
    """``path``: a ``run-*.wandb`` file or the run directory that holds one. Waits up to ``wait_s`` seconds for
    the run's ``exit`` record; a run without one (a crashed process) is read as far as it was written."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.wandb")) or sorted(path.glob("**/run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"no run-*.wandb file under {path}")
        path = files[0]
    deadline = time.monotonic() + wait_s
    run = _parse_run_file(path)
    while not run.finished and time.monotonic() < deadline:
        time.sleep(0.1)
        run = _parse_run_file(path)
    return run


def _parse_run_file(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2

    run = OfflineRun(files_dir=path.parent / "files")
    for raw in iter_record_bytes(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "config":
            for item in record.config.update:
                value = json.loads(item.value_json)
                run.config[_item_key(item)] = value.get("value", value) if isinstance(value, dict) else value
        elif kind == "run":
            run.group, run.name = record.run.run_group, record.run.display_name
            for item in record.run.config.update:
                value = json.loads(item.value_json)
                run.config[_item_key(item)] = value.get("value", value) if isinstance(value, dict) else value
        elif kind == "exit":
            run.finished = True
    return run
