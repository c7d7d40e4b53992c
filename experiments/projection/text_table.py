"""Fixed-width text tables for the terminal: a header, a rule, one line per row. The cost model's
projection table (``scaling``) and its measured-versus-predicted comparison (``scaling_check``) are
printed with it. Hand-written (a dozen lines) rather than a dependency: ``rich`` tables wrap and
restyle cells to the terminal, and these tables are read in logs and compared line by line."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column of a :func:`text_table`."""

    title: str
    """Header text."""
    width: int
    """Characters the column takes: header and cells are padded to it (a longer one is kept whole)."""
    cell: Callable[[Row], str]
    """A row -> the cell's text (see :func:`number`)."""
    left: bool = False
    """Left-align (names) instead of right-align (numbers)."""

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 1:
            raise ValueError(f"Column {self.title!r}: width must be a positive int, got {self.width!r}")

    def pad(self, text: str) -> str:
        return text.ljust(self.width) if self.left else text.rjust(self.width)


def number(key: str, spec: str, *, scale: float = 1, suffix: str = "") -> Callable[[Row], str]:
    """A cell: ``row[key]`` (times ``scale``) in format ``spec`` (e.g. ``".2f"``), then ``suffix``."""

    def cell(row: Row) -> str:
        value = row[key] if scale == 1 else row[key] * scale
        return format(value, spec) + suffix

    return cell


def text_table(columns: Sequence[Column], rows: Sequence[Row]) -> str:
    """The table: header, a rule as wide as the header, one line per row; columns one space apart."""
    head = " ".join(c.pad(c.title) for c in columns)
    lines = [head, "-" * len(head)]
    lines += [" ".join(c.pad(c.cell(r)) for c in columns) for r in rows]
    return "\n".join(lines)
