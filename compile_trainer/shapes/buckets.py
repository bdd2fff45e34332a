"""Bucket lengths chosen from the data (``shapes.pad.auto``), and the padding they cost.

Each batch is padded to the smallest bucket that holds it, so a set of buckets costs the positions between a
batch's length and its bucket, times the batch's rows. ``choose_buckets`` finds the set of ``count`` lengths
with the least such cost over observed batch lengths, exactly (a dynamic program over the distinct lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class LengthSample:
    """A batch's length along the padded dimension, and how many rows (sequences) share it."""

    length: int
    rows: int = 1


def _round_up(length: int, multiple_of: int) -> int:
    return -(-length // multiple_of) * multiple_of


def padded_positions(samples: Sequence[LengthSample], buckets: Sequence[int]) -> Tuple[int, int]:
    """(real positions, positions after padding) of ``samples`` under ``buckets``; a sample longer than every
    bucket counts at its own length (it overflows)."""
    real = padded = 0
    for sample in samples:
        bucket = next((b for b in buckets if b >= sample.length), sample.length)
        real += sample.rows * sample.length
        padded += sample.rows * bucket
    return real, padded


def padding_overhead(samples: Sequence[LengthSample], buckets: Sequence[int]) -> float:
    """Padded positions per real position (0.25: a quarter more positions than the data has)."""
    real, padded = padded_positions(samples, buckets)
    return (padded - real) / real if real else 0.0


def choose_buckets(
    samples: Sequence[LengthSample], count: int, multiple_of: int = 1, longest: Optional[int] = None
) -> List[int]:
    """At most ``count`` ascending bucket lengths, multiples of ``multiple_of``, that pad ``samples`` least.

    The largest bucket is ``longest`` when given (it must hold every sample), else the longest sample rounded up.
    """
    if not samples:
        raise ValueError("choose_buckets needs at least one observed batch length")
    top = _round_up(max(s.length for s in samples), multiple_of)
    if longest is not None:
        if longest < top:
            raise ValueError(f"longest bucket {longest} is shorter than an observed batch ({top} after rounding)")
        top = longest
    # rows and row-weighted lengths per candidate bucket (each sample's length rounded up)
    rows: Dict[int, int] = {}
    weighted: Dict[int, int] = {}
    for sample in samples:
        at = _round_up(sample.length, multiple_of)
        rows[at] = rows.get(at, 0) + sample.rows
        weighted[at] = weighted.get(at, 0) + sample.rows * sample.length
    candidates = sorted(set(rows) | {top})
    # prefix sums: rows and row-weighted lengths of candidates before index i
    rows_before, weighted_before = [0], [0]
    for c in candidates:
        rows_before.append(rows_before[-1] + rows.get(c, 0))
        weighted_before.append(weighted_before[-1] + weighted.get(c, 0))

    def cost(first: int, last: int) -> int:
        """Padding of candidates ``first..last`` (indices) all padded to candidate ``last``."""
        n_rows = rows_before[last + 1] - rows_before[first]
        return n_rows * candidates[last] - (weighted_before[last + 1] - weighted_before[first])

    size = len(candidates)
    count = min(count, size)
    # best[k][j]: least padding of candidates 0..j with k buckets, the largest at candidate j
    best = [[cost(0, j) for j in range(size)]]
    choice: List[List[int]] = [[-1] * size]
    for _ in range(1, count):
        row, picks = [], []
        for j in range(size):
            options = [(best[-1][i] + cost(i + 1, j), i) for i in range(j)] or [(best[-1][j], -1)]
            value, pick = min(options)
            row.append(value)
            picks.append(pick)
        best.append(row)
        choice.append(picks)
    buckets, j, k = [], size - 1, count - 1
    while j >= 0 and k >= 0:
        buckets.append(candidates[j])
        j, k = choice[k][j], k - 1
    return sorted(buckets)
