"""Fixed-width text tables for the console (plan, telemetry summary, sweep report, benchmarks)."""

from __future__ import annotations

from typing import Iterable, List, Sequence


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
    """Lines of a left-aligned table: the header, a dashed rule, then one line per row."""
    rows = [list(row) for row in rows]
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(header)]

    def line(cells: Iterable[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return [line(header), line("-" * width for width in widths), *(line(row) for row in rows)]
