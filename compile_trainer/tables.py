"""Fixed-width text tables for the console (plan, telemetry summary, sweep report, benchmarks), and counted nouns."""

from __future__ import annotations

from typing import Iterable, List, Sequence


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
    """Lines of a left-aligned table: the header, a dashed rule, then one line per row."""
    rows = [list(row) for row in rows]
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(header)]

    def line(cells: Iterable[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return [line(header), line("-" * width for width in widths), *(line(row) for row in rows)]


def plural(count: int, noun: str, nouns: str = "") -> str:
    """``count`` with ``noun`` or, unless ``count`` is 1, its plural (``nouns``, else ``noun`` + "s"):
    ``1 region``, ``3 regions``, ``2 entries`` (``plural(2, "entry", "entries")``)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
