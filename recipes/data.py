"""Real text that is always available offline: the Python standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import List, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


def stdlib_source_files() -> List[Path]:
    """The ``.py`` files of the running interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def read_stdlib_bytes(max_bytes: int, files: Optional[List[Path]] = None) -> List[bytes]:
    """Whole files' bytes, in order, until ``max_bytes`` are collected."""
    texts, total = [], 0
    for path in files if files is not None else stdlib_source_files():
        data = path.read_bytes()
        texts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python source files found under {sysconfig.get_paths()['stdlib']}")
    return texts


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` byte tokens: ``(inputs, next-token targets)``."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int):
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level language modelling on the standard library's source; the last files are validation."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.max_bytes, self.val_fraction = max_bytes, val_fraction
        self.num_workers, self.seed = num_workers, seed
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        texts = read_stdlib_bytes(self.max_bytes)
        n_val = max(1, int(len(texts) * self.val_fraction))

        def to_tokens(parts: List[bytes]) -> torch.Tensor:
            return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

        self.train_set = TokenWindows(to_tokens(texts[:-n_val]), self.block_size)
        self.val_set = TokenWindows(to_tokens(texts[-n_val:]), self.block_size)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set,
            self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, shuffle=False, drop_last=True, num_workers=self.num_workers)
