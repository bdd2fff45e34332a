"""Real text that is always available offline: the Python standard library's own source files."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


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


class TokenBatch(NamedTuple):
    """Token ids and their next-token targets; a sample, or a batch once collated (entries by name)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def split_train_val(max_bytes: int, val_fraction: float) -> Tuple[List[bytes], List[bytes]]:
    """Whole files for training, the last ``val_fraction`` of them (at least one) for validation."""
    texts = read_stdlib_bytes(max_bytes)
    n_val = max(1, int(len(texts) * val_fraction))
    return texts[:-n_val], texts[-n_val:]


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
        return TokenBatch(window[:-1], window[1:])


class StdlibSourceDataModule(pl.LightningDataModule):
    """The standard library's source as training text, its last files (``val_fraction``) as validation;
    subclasses turn each part's texts into a dataset (``make_dataset``) and batch it."""

    def __init__(
        self, block_size: int, batch_size: int, max_bytes: int, val_fraction: float, num_workers: int, seed: int
    ):
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.max_bytes, self.val_fraction = max_bytes, val_fraction
        self.num_workers, self.seed = num_workers, seed
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def make_dataset(self, texts: List[bytes]) -> Dataset:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        train_texts, val_texts = split_train_val(self.max_bytes, self.val_fraction)
        self.train_set, self.val_set = self.make_dataset(train_texts), self.make_dataset(val_texts)


class StdlibTextDataModule(StdlibSourceDataModule):
    """Byte-level language modelling on the standard library's source, in windows of ``block_size``."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(block_size, batch_size, max_bytes, val_fraction, num_workers, seed)

    def make_dataset(self, texts: List[bytes]) -> TokenWindows:
        return TokenWindows(torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8), self.block_size)

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


# ---------------------------------------------------------------------------------------------------------
# Variable-length samples: one paragraph of source (the text between blank lines) per sample

PARAGRAPH_BREAK = re.compile(rb"\n[ \t]*\n")


def split_paragraphs(text: bytes, min_length: int, max_length: int) -> List[bytes]:
    """``text``'s paragraphs (a function, a method, a docstring, an import block...), cut at ``max_length``."""
    paragraphs = (part.strip(b"\n") for part in PARAGRAPH_BREAK.split(text))
    return [part[:max_length] for part in paragraphs if len(part) >= min_length]


class Paragraphs(Dataset):
    """One paragraph per sample: ``TokenBatch(inputs, targets)`` of its own length (``len(paragraph) - 1``)."""

    def __init__(self, texts: Sequence[bytes], block_size: int, min_length: int):
        self.samples = [p for text in texts for p in split_paragraphs(text, min_length + 1, block_size + 1)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TokenBatch:
        tokens = torch.frombuffer(bytearray(self.samples[index]), dtype=torch.uint8).long()
        return TokenBatch(tokens[:-1], tokens[1:])

    def lengths(self) -> List[int]:
        return [len(sample) - 1 for sample in self.samples]


class PadToLongest:
    """Collate ``TokenBatch`` samples, padding to the batch's longest: ids with ``pad_token_id``, targets with
    ``ignore_index`` (which the loss skips, so padding never changes it)."""

    def __init__(self, pad_token_id: int = 0, ignore_index: int = -100):
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index

    def __call__(self, samples: List[TokenBatch]) -> TokenBatch:
        length = max(len(sample.inputs) for sample in samples)
        inputs = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(samples), length), self.ignore_index, dtype=torch.long)
        for row, sample in enumerate(samples):
            inputs[row, : len(sample.inputs)] = sample.inputs
            targets[row, : len(sample.targets)] = sample.targets
        return TokenBatch(inputs, targets)


def token_positions(batch: TokenBatch) -> int:
    """Token positions in a batch, padding included (from its shape: no device sync)."""
    return batch.inputs.numel()


class LengthGroupedBatches(Sampler[List[int]]):
    """Batches of similar lengths, so that batch lengths really vary (a random batch of paragraphs is
    almost always as long as its longest, capped one). Indices are shuffled, cut into groups of
    ``group_batches`` batches, sorted by length within a group and batched; the batches are shuffled.
    Without ``drop_last`` one batch (the last group's last) may be smaller."""

    def __init__(
        self,
        lengths: List[int],
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        seed: int = 0,
        group_batches: int = 32,
    ):
        self.lengths, self.batch_size, self.shuffle, self.drop_last = lengths, batch_size, shuffle, drop_last
        self.group = batch_size * group_batches
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[List[int]]:
        count = len(self.lengths)
        order = torch.randperm(count, generator=self.generator).tolist() if self.shuffle else list(range(count))
        batches = []
        for start in range(0, count, self.group):
            group = sorted(order[start : start + self.group], key=self.lengths.__getitem__)
            batches += [group[i : i + self.batch_size] for i in range(0, len(group), self.batch_size)]
        if self.drop_last:  # only the last group's last batch can be smaller
            batches = [batch for batch in batches if len(batch) == self.batch_size]
        if self.shuffle:
            permutation = torch.randperm(len(batches), generator=self.generator).tolist()
            batches = [batches[i] for i in permutation]
        return iter(batches)

    def __len__(self) -> int:
        full, rest = divmod(len(self.lengths), self.batch_size)
        return full if self.drop_last or not rest else full + 1


class StdlibParagraphsDataModule(StdlibSourceDataModule):
    """Variable-length language modelling: one paragraph of standard-library source per sample, at most
    ``block_size`` tokens, batched with similar lengths and padded to the batch's longest. The last files
    are validation, batched by ``val_batch_size`` (``batch_size`` if not given)."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        val_batch_size: Optional[int] = None,
        min_length: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        drop_last: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        collate_fn: Optional[Callable[[List[TokenBatch]], TokenBatch]] = None,
    ):
        super().__init__(block_size, batch_size, max_bytes, val_fraction, num_workers, seed)
        self.val_batch_size = val_batch_size or batch_size
        self.min_length, self.drop_last = min_length, drop_last
        self.collate_fn = collate_fn or PadToLongest(pad_token_id, ignore_index)

    def make_dataset(self, texts: List[bytes]) -> Paragraphs:
        return Paragraphs(texts, self.block_size, self.min_length)

    def _loader(self, dataset: Paragraphs, batch_size: int, shuffle: bool) -> DataLoader:
        sampler = LengthGroupedBatches(dataset.lengths(), batch_size, shuffle, self.drop_last, self.seed)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=self.collate_fn, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.val_batch_size, shuffle=False)
