"""The row types every data source yields (a Tülu 3 chat row, :class:`RowSource`); JSON lines."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass
class RowSource:
    """A re-iterable, ordered collection of chat rows (the same order on every iteration)."""

    name: str
    fingerprint: str  # changes whenever the rows may have changed (part of the cache key)
    iter_rows: Callable[[], Iterator[Row]]
    num_rows: int | None = None  # None when not known up front (streaming)
    take_rows: Callable[[Sequence[int]], list[Row]] | None = None  # else ``take`` iterates
    row_limit: int | None = None  # the user's ``num_rows`` when it cut the dataset (reported)
    # one bool per row (True: validation): the cache splits by it instead of its fraction
    split_mask: Callable[[], Sequence[bool]] | None = None
    report: Callable[[], dict[str, Any]] | None = None  # summary.json's ``source_report``

    def __iter__(self) -> Iterator[Row]:
        return self.iter_rows()

    def take(self, positions: Sequence[int]) -> list[Row]:
        """The rows at ``positions`` (0-based order of ``iter_rows``), in the given order."""
        if self.take_rows is not None:
            return self.take_rows(positions)
        wanted = [int(p) for p in positions]
        keep = set(wanted)
        found = {p: row for p, row in enumerate(self.iter_rows()) if p in keep}
        missing = [p for p in wanted if p not in found]
        if missing:
            raise IndexError(f"{self.name}: positions {missing[:5]} are past the end")
        return [found[p] for p in wanted]


def write_jsonl(rows: Iterable[Row], path: str | os.PathLike[str]) -> None:
    """Writes rows as JSON lines, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: str | os.PathLike[str]) -> list[Row]:
    """Reads the rows of a JSON-lines file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def default_cache_dir() -> Path:
    """``$MTPC_CACHE`` if set, else ``<repo>/.cache/mtpc`` (git-ignored)."""
    env = os.environ.get("MTPC_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache" / "mtpc"
