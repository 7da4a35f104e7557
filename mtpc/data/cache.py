"""On-disk cache of tokenised documents, splits and packing plans (docs/DATA.md, "Caching").

A folder per key under ``<cache_dir>/data/`` (files: ``_build_cache``; ``meta.json`` holds the
others' sizes and hashes), written under a temporary name and renamed into place: a crash never
leaves a half-written cache and concurrent ranks never read one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtpc.backbones.codecs import get_codec
from mtpc.data.packing import PackPlan, plan_packing
from mtpc.data.preprocess import (
    DEFAULT_MAX_BYTES,
    DEFAULT_VALIDATION_FRACTION,
    split_indices,
    tokenize_rows,
)
from mtpc.data.rows import Row, RowSource, read_jsonl, write_jsonl
from mtpc.errors import DataError
from mtpc.files import remove_stale_tmp

logger = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the format or the preprocessing changes (2: file hashes)

SPLITS = ("train", "val")


class CacheCorruptError(DataError):
    """A cache folder's files do not match the sizes and hashes in its ``meta.json``."""


def file_digest(path: Path) -> str:
    """BLAKE2b (128-bit) hex digest of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def verify_files(folder: Path, meta: dict[str, Any], hashes: bool = True) -> None:
    """Checks the files of ``meta["files"]`` (sizes; hashes when ``hashes``), or raises
    ``CacheCorruptError`` naming the folder and the file."""
    records = meta.get("files")
    if not isinstance(records, dict) or not records:
        raise _corrupt(folder, "meta.json", "has no file sizes and hashes")
    for name, record in records.items():
        path = folder / name
        if not path.is_file():
            raise _corrupt(folder, name, "is missing")
        size = path.stat().st_size
        if size != record.get("size"):
            raise _corrupt(folder, name, f"has {size} bytes, meta.json says {record.get('size')}")
        if hashes and file_digest(path) != record.get("blake2b"):
            raise _corrupt(folder, name, "differs from its hash in meta.json")


def _corrupt(folder: Path, name: str, what: str) -> CacheCorruptError:
    return CacheCorruptError(
        f"data cache {folder} is corrupt: {name} {what}; it is rebuilt automatically by the "
        f"data module, or delete the folder (rm -r {folder}) to rebuild it"
    )


@dataclass
class PreparedData:
    """A prepared dataset read back from its cache folder (arrays are memory mapped)."""

    folder: Path
    meta: dict[str, Any]
    summary: dict[str, Any]
    ids: np.ndarray  # (T,) uint16
    assistant: np.ndarray  # (T,) bool loss mask
    offsets: np.ndarray  # (D+1,) int64 document boundaries
    doc_source: np.ndarray  # (D,) int32 source id
    splits: dict[str, np.ndarray]  # train / val -> document indices

    @property
    def source_names(self) -> list[str]:
        return list(self.meta["source_names"])

    def doc_lengths(self, split: str) -> np.ndarray:
        """(D_split,) lengths of the split's documents, in split order."""
        docs = self.splits[split]
        return (self.offsets[docs + 1] - self.offsets[docs]).astype(np.int64)

    def val_rows(self) -> list[Row]:
        """The raw validation rows, in validation-split order."""
        return read_jsonl(self.folder / "val_rows.jsonl")

    def pack_plan(self, split: str, seq_len: int, pack: bool = True) -> PackPlan:
        """The split's packing plan (``pack=False``: one document per sequence), cached."""
        path = self.folder / f"pack-L{seq_len}{'' if pack else '-single'}-{split}.npz"
        if path.is_file():
            try:
                with np.load(path) as arrays:
                    return PackPlan.from_arrays(dict(arrays))
            except Exception as err:  # a damaged plan is derived data: recompute it
                logger.warning("packing plan %s is unreadable (%s); recomputing it", path, err)
                path.unlink(missing_ok=True)
        start = time.perf_counter()
        plan = plan_packing(self.doc_lengths(split), seq_len, pack)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **plan.to_arrays())  # type: ignore[arg-type]
        os.replace(tmp, path)
        logger.info(
            "packed %d %s documents into %d sequences of %d (fill %.4f) in %.1fs",
            len(self.splits[split]),
            split,
            plan.num_sequences,
            seq_len,
            plan.fill_ratio(),
            time.perf_counter() - start,
        )
        return plan


def prepare(
    source: RowSource,
    codec: str,
    cache_dir: str | os.PathLike[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int = 0,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> Path:
    """Tokenises, filters and splits ``source`` into its cache folder (returned) unless it is
    there already; ``DataError`` when no row is usable (naming the dataset and the counts)."""
    parts = {  # the key: the folder is named after a hash of it
        "version": CACHE_VERSION,
        "dataset": source.fingerprint,
        "codec": codec,
        "max_bytes": int(max_bytes),
        "seed": int(seed),
        "validation_fraction": float(validation_fraction),
    }
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", source.name)[:48].strip("_") or "data"
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    name = f"{slug}-{codec}-ctx{max_bytes}-seed{seed}-{key[:16]}"
    folder = Path(cache_dir) / "data" / name
    if (folder / "meta.json").is_file():
        logger.info("data cache hit: %s", folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(folder.parent, "an interrupted data preparation")
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _build_cache(tmp, folder, parts, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build_cache(tmp: Path, folder: Path, parts: dict[str, Any], source: RowSource) -> None:
    """Writes ``prepare``'s files (key ``parts``) into ``tmp``, to be renamed ``folder``."""
    start = time.perf_counter()
    codec, max_bytes = parts["codec"], parts["max_bytes"]
    with (
        (tmp / "ids.u16").open("wb") as ids_file,
        (tmp / "assistant.u8").open("wb") as mask_file,
    ):
        docs, stats = tokenize_rows(source, get_codec(codec), max_bytes, ids_file, mask_file)
    stats.log(source.name)
    if source.row_limit is not None:
        logger.warning(
            "%s: limited to its first %d rows by data.num_rows=%d (data.num_rows=null reads "
            "every row)",
            source.name,
            source.row_limit,
            source.row_limit,
        )
    if docs.num_docs == 0:
        _write_json(
            summary_path(folder), {"dataset": source.name, "codec": codec, **stats.as_dict()}
        )
        raise DataError(
            f"dataset {source.name!r} has no usable rows: {stats.rows_seen} rows read, "
            f"dropped by reason { ({k: v for k, v in stats.dropped.items() if v}) }"
        )
    if source.split_mask is None:
        train, val = split_indices(docs.num_docs, parts["seed"], parts["validation_fraction"])
    else:  # the source's own split (one bool per row: validation), shuffled by the seed
        held = np.asarray(source.split_mask(), dtype=np.bool_)[docs.row_positions]  # (D,)
        perm = np.random.default_rng(parts["seed"]).permutation(docs.num_docs).astype(np.int64)
        train, val = perm[~held[perm]], perm[held[perm]]
    np.save(tmp / "offsets.npy", docs.offsets)
    np.save(tmp / "doc_source.npy", docs.source_ids)
    np.save(tmp / "doc_row.npy", docs.row_positions)
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    write_jsonl(source.take(docs.row_positions[val].tolist()), tmp / "val_rows.jsonl")
    summary = {
        "dataset": source.name,
        "codec": codec,
        "max_bytes": max_bytes,
        "row_limit": source.row_limit,
        **stats.as_dict(),
        "train_docs": len(train),
        "val_docs": len(val),
        "seconds": round(time.perf_counter() - start, 3),
    }
    if source.report is not None:
        summary["source_report"] = source.report()
    meta = {
        **parts,
        "name": source.name,
        "num_docs": docs.num_docs,
        "num_ids": int(docs.offsets[-1]),
        "source_names": docs.source_names,
    }
    _write_json(tmp / "summary.json", summary)
    _write_json(summary_path(folder), summary)
    meta["files"] = {
        f.name: {"size": f.stat().st_size, "blake2b": file_digest(f)}
        for f in sorted(tmp.iterdir())
        if f.is_file() and f.name != "meta.json"
    }
    _write_json(tmp / "meta.json", meta)
    logger.info(
        "prepared %s: %d documents (%d train / %d val), %d ids in %.1fs -> %s",
        source.name,
        meta["num_docs"],
        summary["train_docs"],
        summary["val_docs"],
        meta["num_ids"],
        summary["seconds"],
        folder,
    )


def load_prepared(folder: str | os.PathLike[str], verify: bool = True) -> PreparedData:
    """Reads a cache folder written by ``prepare`` (the big arrays memory mapped); raises
    ``CacheCorruptError`` when a file is missing, unreadable or differs from meta.json.
    ``verify=False`` (dataloader workers reopening a verified folder) checks sizes only."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(folder, "meta.json", f"is unreadable ({err})") from err
    verify_files(folder, meta, hashes=verify)
    try:
        num_ids = int(meta["num_ids"])
        return PreparedData(
            folder=folder,
            meta=meta,
            summary=json.loads((folder / "summary.json").read_text()),
            ids=_memmap(folder / "ids.u16", "<u2", num_ids),
            assistant=_memmap(folder / "assistant.u8", np.bool_, num_ids),
            offsets=np.load(folder / "offsets.npy"),
            doc_source=np.load(folder / "doc_source.npy"),
            splits={split: np.load(folder / f"{split}.npy") for split in SPLITS},
        )
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise _corrupt(folder, "a file", f"is unreadable ({err})") from err


_VERIFIED: set[tuple[str, str]] = set()


def ensure_prepared(
    source: RowSource,
    codec: str,
    cache_dir: str | os.PathLike[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int = 0,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> PreparedData:
    """``prepare`` then ``load_prepared``; a corrupt cache folder is removed and rebuilt once."""
    folder = prepare(source, codec, cache_dir, max_bytes, seed, validation_fraction)
    try:
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir())
        stamp = (str(folder), repr(files))  # changes when any file is rewritten
        data = load_prepared(folder, verify=stamp not in _VERIFIED)
        _VERIFIED.add(stamp)  # prepare_data and setup of one process hash the files once
        return data
    except (CacheCorruptError, OSError) as err:
        logger.warning("%s; rebuilding it now", str(err).split("; it is rebuilt")[0])
        shutil.rmtree(folder, ignore_errors=True)
    folder = prepare(source, codec, cache_dir, max_bytes, seed, validation_fraction)
    return load_prepared(folder)


def _memmap(path: Path, dtype: Any, length: int) -> np.ndarray:
    """(length,) of ``path`` memory mapped (an empty array for an empty file)."""
    if not length:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))


def summary_path(folder: str | os.PathLike[str]) -> Path:
    """The copy of ``summary.json`` next to a cache folder (also written when preparing fails)."""
    folder = Path(folder)
    return folder.with_name(f"{folder.name}.summary.json")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
