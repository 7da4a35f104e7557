"""Chat rows -> byte ids with assistant masks, malformed rows counted, seeded 99 % / 1 % split.

A row is dropped, never crashing the run, for the first reason of ``DROP_REASONS`` that
applies; the counts go to the log and ``summary.json`` (docs/DATA.md, "Preprocessing").
Beyond the names: ``undecodable_text`` also covers ``bytes`` content and strings with lone
surrogates, ``no_messages`` a row that is not a dict, ``unknown_role`` a message that is
not a dict, and ``template_error`` (should stay 0) any other rejection by the codec.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from mtpc.backbones.codecs import ROLES, ByteCodec
from mtpc.data.sources import ERROR_KEY

logger = logging.getLogger(__name__)

DROP_REASONS = (
    "invalid_json", "undecodable_text", "no_messages", "unknown_role", "non_string_content",
    "no_assistant_turn", "empty_assistant_turn", "too_long", "template_error",
)  # fmt: skip

DEFAULT_MAX_BYTES = 8192  # the paper's context limit (ids, the template's special ids too)

DEFAULT_VALIDATION_FRACTION = 0.01
MAX_EXAMPLES_PER_REASON = 5
UNKNOWN_SOURCE = "unknown"


def check_row(row: Any) -> str | None:
    """The reason ``row`` must be dropped, or None; ``too_long`` is left to ``tokenize_rows``."""
    if not isinstance(row, Mapping):
        return "no_messages"
    if ERROR_KEY in row:
        return str(row[ERROR_KEY])
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no_messages"
    has_assistant = False
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            return "unknown_role"
        content = message.get("content")
        if isinstance(content, bytes | bytearray):
            try:
                bytes(content).decode("utf-8")
            except UnicodeDecodeError:
                return "undecodable_text"
            return "non_string_content"
        if not isinstance(content, str):
            return "non_string_content"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            return "undecodable_text"
        if message["role"] == "assistant":
            has_assistant = True
            if not content.strip():
                return "empty_assistant_turn"
    return None if has_assistant else "no_assistant_turn"


@dataclass
class DropStats:
    """What happened to the rows of one dataset."""

    rows_seen: int = 0
    rows_used: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first row ids
    used_bytes: int = 0  # ids of the kept documents
    sources: dict[str, int] = field(default_factory=dict)  # source -> kept documents

    def drop(self, reason: str, row_id: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        ids = self.examples.setdefault(reason, [])
        if len(ids) < MAX_EXAMPLES_PER_REASON:
            ids.append(row_id)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows_seen": self.rows_seen,
            "rows_used": self.rows_used,
            "rows_dropped": sum(self.dropped.values()),
            "dropped": dict(self.dropped),
            "dropped_examples": dict(self.examples),
            "used_bytes": self.used_bytes,
            "sources": dict(sorted(self.sources.items())),
        }

    def log(self, dataset: str) -> None:
        """Logs the counts; a warning when anything was dropped."""
        nonzero = {k: v for k, v in self.dropped.items() if v}
        message = f"{dataset}: {self.rows_used} of {self.rows_seen} rows usable"
        if nonzero:
            logger.warning("%s; dropped %s (first ids: %s)", message, nonzero, self.examples)
        else:
            logger.info("%s; none dropped", message)


@dataclass
class TokenizedDocs:
    """Documents in memory (the on-disk form lives in ``mtpc.data.cache``)."""

    ids: np.ndarray  # (T,) uint16, all documents back to back
    assistant: np.ndarray  # (T,) bool, assistant bytes and their end-of-turn ids
    offsets: np.ndarray  # (D+1,) int64, document d is ids[offsets[d]:offsets[d+1]]
    source_ids: np.ndarray  # (D,) int32, index into source_names
    source_names: list[str]  # sorted
    row_positions: np.ndarray  # (D,) int64, the row's position in the source

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1


def tokenize_rows(
    rows: Iterable[Any],
    codec: ByteCodec,
    max_bytes: int = DEFAULT_MAX_BYTES,
    ids_file: BinaryIO | None = None,
    mask_file: BinaryIO | None = None,
) -> tuple[TokenizedDocs, DropStats]:
    """Validates rows and renders them with ``codec``'s chat template, in source order (over
    ``max_bytes`` ids: ``too_long``). With ``ids_file`` and ``mask_file`` (both or neither), ids
    and mask are streamed there as raw uint16 / uint8 and the returned arrays are empty (flat
    memory for Tülu's 939k rows)."""
    if codec.vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(
            f"codec {codec.name} has {codec.vocab_size} ids; uint16 storage needs < 65536"
        )
    stats = DropStats()
    id_chunks: list[np.ndarray] = []
    mask_chunks: list[np.ndarray] = []
    lengths: list[int] = []
    source_of: list[str] = []
    positions: list[int] = []
    for position, row in enumerate(rows):
        stats.rows_seen += 1
        reason = check_row(row)
        if reason is None:
            try:  # in codec's chat template
                enc = codec.apply_chat_template(row["messages"])
            except (ValueError, UnicodeError):
                reason = "template_error"
            else:
                reason = "too_long" if len(enc.ids) > max_bytes else None
        if reason is not None:
            stats.drop(reason, _row_id(row, position))
            continue
        ids = np.asarray(enc.ids, dtype=np.uint16)
        mask = np.asarray(enc.assistant_mask, dtype=np.bool_)
        if ids_file is not None and mask_file is not None:
            ids_file.write(ids.tobytes())
            mask_file.write(mask.tobytes())
        else:
            id_chunks.append(ids)
            mask_chunks.append(mask)
        source = row.get("source")
        source = source if isinstance(source, str) and source else UNKNOWN_SOURCE
        lengths.append(len(ids))
        source_of.append(source)
        positions.append(position)
    stats.rows_used = len(lengths)
    stats.used_bytes = int(sum(lengths))
    stats.sources = dict(Counter(source_of))
    names = sorted(stats.sources)
    index = {name: i for i, name in enumerate(names)}
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    docs = TokenizedDocs(
        ids=np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.uint16),
        assistant=np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.bool_),
        offsets=offsets,
        source_ids=np.asarray([index[s] for s in source_of], dtype=np.int32),
        source_names=names,
        row_positions=np.asarray(positions, dtype=np.int64),
    )
    return docs, stats


def split_indices(
    num_docs: int, seed: int = 0, validation_fraction: float = DEFAULT_VALIDATION_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffles ``range(num_docs)`` with ``seed`` and cuts it into (train, validation): validation
    gets ``round(validation_fraction * num_docs)`` documents (at least one when the fraction is > 0
    and there are 2+ documents); both keep the shuffled order. ``ValueError`` for a
    ``validation_fraction`` outside [0, 1)."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    perm = np.random.default_rng(seed).permutation(num_docs).astype(np.int64)
    n_val = round(validation_fraction * num_docs)
    if validation_fraction > 0 and num_docs >= 2:
        n_val = max(1, n_val)
    n_val = min(n_val, max(num_docs - 1, 0))
    return perm[n_val:], perm[:n_val]


def _row_id(row: Any, position: int) -> str:
    if isinstance(row, Mapping):
        value = row.get("id")
        if isinstance(value, str | int) and str(value):
            return str(value)
    return f"row-{position}"
