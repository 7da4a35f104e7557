"""Deterministic best-fit-decreasing packing of documents into fixed-length sequences.

Longest first, each document goes into the open sequence with the least room that fits it
(ties: the sequence opened last), else a new one; a document longer than ``seq_len`` is cut
into ``seq_len``-sized pieces plus a remainder, packed as separate documents. The plan
depends on the lengths only, so it is cacheable. See docs/DATA.md, "Preprocessing".
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class PackPlan:
    """Which pieces (segments) of which documents make up each packed sequence: sequence k
    holds segments ``seq_offsets[k]:seq_offsets[k+1]``, in placement order."""

    seq_len: int  # L
    seq_offsets: np.ndarray  # (S+1,) int64
    seg_doc: np.ndarray  # (G,) int64, index into the split's document list
    seg_start: np.ndarray  # (G,) int64, first id of the segment within its document
    seg_len: np.ndarray  # (G,) int64

    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    def fill_ratio(self) -> float:
        """Share of non-padding positions over all sequences."""
        total = self.num_sequences * self.seq_len
        return float(self.seg_len.sum() / total) if total else 0.0

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f.name: np.asarray(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> PackPlan:
        segments = (np.asarray(arrays[f.name], dtype=np.int64) for f in fields(cls)[1:])
        return cls(int(arrays["seq_len"]), *segments)


def plan_packing(doc_lengths: np.ndarray, seq_len: int, pack: bool = True) -> PackPlan:
    """Plans (D,) documents of ``doc_lengths`` (split order, each >= 1) into sequences of
    ``seq_len`` >= 1: every id in exactly one segment. ``pack=False`` puts each document (or
    piece) in a sequence of its own, for a target whose attention cannot keep packed documents
    apart (EvaByte; docs/TRAINING.md)."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    # pieces (doc, start, length): full seq_len chunks of long documents, each filling a
    # sequence, and the remainders, which are packed
    full: list[tuple[int, int, int]] = []
    items: list[tuple[int, int, int]] = []
    for doc, length in enumerate(lengths.tolist()):
        cut = (length - 1) // seq_len * seq_len  # the remainder's start
        full.extend((doc, start, seq_len) for start in range(0, cut, seq_len))
        items.append((doc, cut, length - cut))
    bins: list[list[int]] = []  # sequence -> item indices
    by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]  # room -> open sequences
    rooms: list[int] = []  # the rooms with an open sequence, sorted (at most seq_len)
    sizes = np.asarray([size for _, _, size in items], dtype=np.int64)
    for item in np.argsort(-sizes, kind="stable").tolist():
        size = items[item][2]
        if not pack:
            bins.append([item])
            continue
        at = bisect.bisect_left(rooms, size)  # the least room >= size
        if at < len(rooms):
            room = rooms[at]
            seq = by_room[room].pop()
            if not by_room[room]:
                rooms.pop(at)
        else:
            seq, room = len(bins), seq_len
            bins.append([])
        bins[seq].append(item)
        left = room - size
        if left > 0:
            if not by_room[left]:
                bisect.insort(rooms, left)
            by_room[left].append(seq)
    segments = full + [items[item] for members in bins for item in members]
    seg_doc, seg_start, seg_len = np.asarray(segments, dtype=np.int64).reshape(-1, 3).T.copy()
    counts = [0] + [1] * len(full) + [len(members) for members in bins]
    return PackPlan(seq_len, np.cumsum(counts, dtype=np.int64), seg_doc, seg_start, seg_len)


def build_sequence(
    plan: PackPlan,
    index: int,
    ids: np.ndarray,
    assistant: np.ndarray,
    doc_offsets: np.ndarray,
    doc_sources: np.ndarray,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Materialises packed sequence ``index`` of ``plan``: ``ids`` / ``assistant`` (T,) are the
    corpus store, ``doc_offsets`` / ``doc_sources`` (D,) each split document's start in it and
    source id. Returns ``input_ids``, ``position_ids``, ``document_ids`` (segments 0, 1, ... of
    the sequence), ``source_ids`` and ``loss_mask``, each (L,); padding is ``pad_id``,
    position 0, document and source -1, loss False."""
    length = plan.seq_len
    out = {
        "input_ids": np.full(length, pad_id, dtype=np.int64),
        "position_ids": np.zeros(length, dtype=np.int64),
        "document_ids": np.full(length, -1, dtype=np.int64),
        "source_ids": np.full(length, -1, dtype=np.int64),
        "loss_mask": np.zeros(length, dtype=np.bool_),
    }
    pos = 0
    lo, hi = int(plan.seq_offsets[index]), int(plan.seq_offsets[index + 1])
    for local, seg in enumerate(range(lo, hi)):
        doc, start, n = int(plan.seg_doc[seg]), int(plan.seg_start[seg]), int(plan.seg_len[seg])
        begin = int(doc_offsets[doc]) + start
        out["input_ids"][pos : pos + n] = ids[begin : begin + n]
        out["loss_mask"][pos : pos + n] = assistant[begin : begin + n]
        out["position_ids"][pos : pos + n] = np.arange(n)
        out["document_ids"][pos : pos + n] = local
        out["source_ids"][pos : pos + n] = int(doc_sources[doc])
        pos += n
    return out
