"""Where chat rows come from: the Tülu 3 SFT mixture, a local dataset of its schema, the
synthetic generator, or Python source code. Formats: docs/DATA.md, "Accepted input".

Rows are *not* validated here: a row that cannot be read at all (a JSON line that does not
parse, bytes that are not UTF-8) is passed on as ``{ERROR_KEY: reason, "id": ...}``, for
``mtpc.data.preprocess`` to count with the other malformed rows. Our own tolerant JSON reader:
``datasets``' JSON builder infers one Arrow schema and fails on a row whose ``content`` is a number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import Any

from mtpc.data.rows import Row, RowSource
from mtpc.errors import DataError, MissingFileError

logger = logging.getLogger(__name__)

TULU3_DATASET = "allenai/tulu-3-sft-mixture"  # 939,344 rows, 18 sources
ERROR_KEY = "__mtpc_error__"  # marks a row that could not be read; its value is the reason
SOURCES = ("synthetic", "tulu3", "local", "python_code")


def load_source(
    source: str = "synthetic",
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    num_rows: int | None = None,
    seed: int = 0,
    streaming: bool = False,
    revision: str | None = None,
    hf_name: str = TULU3_DATASET,
    validation_fraction: float = 0.05,
) -> RowSource:
    """Opens a row source (the arguments: docs/DATA.md). ``seed`` is the synthetic generator's,
    ``validation_fraction`` python_code's share of held-out files. ``DataError`` for an unknown
    ``source``, ``local`` without ``path`` or an unknown format; ``MissingFileError`` for a ``path``
    that does not exist."""
    if source not in SOURCES:
        raise DataError(f"data source is {source!r}; allowed: {SOURCES}")
    if source == "python_code":
        from mtpc.data.python_code import python_code_source

        if path is not None and not isinstance(path, str | os.PathLike):
            raise DataError(f"data.path={path!r}; allowed for python_code: one folder or null")
        return python_code_source(path, num_rows, validation_fraction)
    if path is not None:  # a path or a list of them (Hydra: ListConfig)
        paths = [path] if isinstance(path, str | os.PathLike) else path
        return _limit(concat_sources([local_source(p) for p in paths]), num_rows)
    if source == "local":
        raise DataError("data source 'local' needs data.path=<jsonl | parquet | arrow dir>")
    if source == "synthetic":
        return synthetic_source(num_rows, seed)
    import datasets  # a hub dataset of the Tülu 3 schema

    try:
        ds = datasets.load_dataset(hf_name, split="train", revision=revision, streaming=streaming)
    except Exception as err:  # offline, gated, renamed: say what to do instead
        raise RuntimeError(
            f"could not load {hf_name!r} (split 'train') from the Hugging Face hub: {err}. "
            "Without network, download it elsewhere and pass data.path=<jsonl | parquet | "
            "arrow dir | save_to_disk dir>"
        ) from err
    label = f"{hf_name}[train]@{revision or 'main'}"
    if streaming:  # keyed by name@revision (pin a commit), else by its Arrow fingerprint
        stream = ds if num_rows is None else ds.take(num_rows)
        return RowSource(label, f"hub-stream:{label}:n{num_rows}", lambda: iter(stream), num_rows)
    return _limit(_arrow_source(ds, label, f"hub:{label}:{ds._fingerprint}"), num_rows)


def synthetic_source(num_rows: int | None = None, seed: int = 0) -> RowSource:
    """The synthetic chat rows of ``mtpc.data.synthetic`` (imported lazily)."""
    from mtpc.data import synthetic

    n = synthetic.DEFAULT_NUM_ROWS if num_rows is None else int(num_rows)
    rows = synthetic.generate_rows(n, seed)
    return RowSource(
        name=f"synthetic(num_rows={n}, seed={seed})",
        fingerprint=f"synthetic:v{synthetic.GENERATOR_VERSION}:n{n}:seed{seed}",
        iter_rows=lambda: iter(rows),
        num_rows=n,
        take_rows=lambda positions: [rows[int(p)] for p in positions],
    )


def local_source(path: str | os.PathLike[str]) -> RowSource:
    """A local dataset of the Tülu 3 schema (docs/DATA.md, "Accepted input");
    ``MissingFileError`` when ``path`` does not exist, ``DataError`` for an unknown format."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MissingFileError(
            f"data.path {str(p)!r} does not exist; allowed: a .jsonl, .json, .parquet or "
            ".arrow file, or a folder of them"
        )
    fingerprint = f"local:{p.resolve()}:{_files_fingerprint(p)}"
    if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
        import datasets

        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            split = "train" if "train" in loaded else next(iter(loaded))
            loaded = loaded[split]
        return _arrow_source(loaded, p.name, fingerprint)
    patterns = ("*.parquet", "*.arrow", "*.jsonl", "*.json")  # a folder: the first that has files
    found = iter([[p]]) if p.is_file() else (sorted(p.rglob(pattern)) for pattern in patterns)
    files = next(filter(None, found), [])
    if not files:
        raise DataError(
            f"data.path {str(p)!r}: no .jsonl, .json, .parquet or .arrow files and no save_to_disk dataset"
        )
    suffix = files[0].suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):
        read = _iter_parquet if suffix == ".parquet" else _iter_json
        return RowSource(p.name, fingerprint, lambda: chain.from_iterable(map(read, files)))
    if suffix == ".arrow":
        import datasets

        ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
        return _arrow_source(ds, p.name, fingerprint)
    raise DataError(
        f"data.path {str(p)!r}: unknown file type {suffix!r}; use .jsonl, .json, .parquet or .arrow"
    )


def concat_sources(sources: Sequence[RowSource]) -> RowSource:
    """The rows of ``sources`` one after another (``data.path=[a,b]``); raises
    ``DataError`` when empty."""
    if not sources:
        raise DataError("data.path is an empty list; allowed: a path or a list of paths")
    if len(sources) == 1:
        return sources[0]
    sizes = [src.num_rows for src in sources]
    total = None if any(n is None for n in sizes) else sum(n for n in sizes if n is not None)
    fingerprint = hashlib.sha256("\n".join(s.fingerprint for s in sources).encode()).hexdigest()
    return RowSource(
        "+".join(src.name for src in sources),
        f"concat:{fingerprint[:16]}",
        lambda: chain.from_iterable(src.iter_rows() for src in sources),
        total,
    )


def _limit(src: RowSource, num_rows: int | None) -> RowSource:
    """``src`` cut to its first ``num_rows`` rows (unchanged when None)."""
    if num_rows is None:
        return src
    n = int(num_rows)
    return RowSource(
        f"{src.name}[:{n}]",
        f"{src.fingerprint}:first{n}",
        lambda: islice(src.iter_rows(), n),
        None if src.num_rows is None else min(n, src.num_rows),
        src.take_rows,
        row_limit=n,
    )


def _arrow_source(ds: Any, name: str, fingerprint: str) -> RowSource:
    """A ``datasets.Dataset`` as a row source, read in batches of columns."""

    def rows() -> Iterator[Row]:
        for batch in ds.iter(batch_size=1024):
            columns = list(batch)
            for i in range(len(batch[columns[0]]) if columns else 0):
                yield {c: batch[c][i] for c in columns}

    def take(positions: Sequence[int]) -> list[Row]:
        return list(ds.select([int(p) for p in positions])) if len(positions) else []

    return RowSource(name, fingerprint, rows, len(ds), take)


def _iter_json(path: Path) -> Iterator[Row]:
    """Rows of a JSON-lines file (or of a ``.json`` file holding one array), tolerantly."""
    with path.open("rb") as f:
        head = f.read(64).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{path}: not a JSON array of rows ({err})") from err
        for position, item in enumerate(data):
            if not isinstance(item, dict):
                item = {ERROR_KEY: "no_messages", "id": f"{path.name}:{position}"}
            yield item
        return
    with path.open("rb") as f:
        for position, raw in enumerate(raw for raw in f if raw.strip()):
            row_id = f"{path.name}:{position}"
            try:
                item = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                item = {ERROR_KEY: "undecodable_text", "id": row_id}
            except json.JSONDecodeError:
                item = {ERROR_KEY: "invalid_json", "id": row_id}
            yield item if isinstance(item, dict) else {ERROR_KEY: "no_messages", "id": row_id}


def _iter_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _files_fingerprint(path: Path) -> str:
    """A hash of (relative name, size, mtime) of ``path`` or of every file under it."""
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        rel = f.name if f == path else str(f.relative_to(path))
        h.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
