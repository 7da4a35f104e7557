"""The row types every data source yields: a Tülu 3 chat row and :class:`RowSource`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


@dataclass
class RowSource:
    """A re-iterable, ordered collection of chat rows.

    Attributes:
        fingerprint: changes whenever the rows may have changed (part of the cache key).
        iter_rows: a fresh iterator over all rows, in the same order every time.
        num_rows: the row count when known up front (None when streaming).
        take_rows: fast random access ``positions -> rows`` (else ``take`` iterates).
        row_limit: the user's ``num_rows`` when it cut the dataset (reported); None: all rows.
        split_mask: one bool per row (True: validation); the cache then splits by it
            instead of its seeded fraction.
        report: what the source itself counted (``summary.json``'s ``source_report``).
    """

    name: str
    fingerprint: str
    iter_rows: Callable[[], Iterator[Row]]
    num_rows: int | None = None
    take_rows: Callable[[Sequence[int]], list[Row]] | None = None
    row_limit: int | None = None
    split_mask: Callable[[], Sequence[bool]] | None = None
    report: Callable[[], dict[str, Any]] | None = None

    def __iter__(self) -> Iterator[Row]:
        return self.iter_rows()

    def take(self, positions: Sequence[int]) -> list[Row]:
        """The rows at ``positions`` (0-based order of ``iter_rows``), in the given order."""
        if self.take_rows is not None:
            return self.take_rows(positions)
        wanted = {int(p): i for i, p in enumerate(positions)}
        out: list[Row | None] = [None] * len(positions)
        for position, row in enumerate(self.iter_rows()):
            if position in wanted:
                out[wanted[position]] = row
        missing = [p for p, i in wanted.items() if out[i] is None]
        if missing:
            raise IndexError(f"{self.name}: positions {missing[:5]} are past the end")
        return [row for row in out if row is not None]
