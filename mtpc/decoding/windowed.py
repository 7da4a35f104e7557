"""B EvaByte rows in one batch, each at its own length in its own EVA window and RFAs.

The layout of ``layout.Padded`` (admit / target / keep / draft / release) for a backbone with
``run_rows`` (EvaByte, :class:`mtpc.backbones.evabyte.EvaRowsCache`): a row is prefilled
alone in one-row caches (the very pass it takes alone) and joins the batch at its next pass;
every later pass is one batched pass per EVA window piece, each row reading only its own
window slots and chunk RFAs. See docs/BACKBONES.md, "EvaByte: many rows".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mtpc.decoding.layout import Stream, Tree, index_of, pad_rows, row_outputs


class Windowed:
    """B rows, in ``rows``' order, in one :class:`EvaRowsCache` per component (trunk,
    verifier tail, draft tail); rows admitted but not yet in it wait in ``fresh``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        backbone, split, n = model.backbone, model.split, model.backbone.num_layers
        spans = ((0, split), (split, n), (split, n))  # trunk, verifier tail, draft tail
        self.natives = [backbone.new_rows_cache(*span) for span in spans]
        self.rows: list[Any] = []
        self.fresh: dict[int, tuple[Any, Stream]] = {}  # id(row) -> (row, its own Stream)
        self.base: list[int] = []  # each row's length before the last target pass

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills each prompt ``(T_b,)`` alone (a :class:`Stream` each); returns the rows'
        trunk states ``(1, T_b, d)`` and their last position's target logits ``(1, V)``."""
        states, logits = [], []
        for row, prompt in zip(rows, prompts, strict=True):
            stream = Stream(self.model)
            (hidden,), (last,) = stream.admit([row], [prompt])
            states.append(hidden)
            logits.append(last)
            self.fresh[id(row)] = (row, stream)
        return states, logits

    def _join(self) -> None:
        """The fresh rows join the batch (their one-row caches settled and appended)."""
        backbone = self.model.backbone
        for row, stream in self.fresh.values():
            for native, cache in zip(self.natives, stream.caches, strict=True):
                if len(native.layers):
                    backbone._settle(cache.native)
                    native.append(cache.native)
            self.rows.append(row)
            self.base.append(0)
        self.fresh = {}

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Tree], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One batched trunk + verifier-tail pass over ``rows``' ``ids`` (T_b,), chains or
        token trees; the other rows sit out. ``last``: logits at each last position only."""
        self._join()
        model, backbone = self.model, self.model.backbone
        at = index_of(self.rows, rows)
        batch = pad_rows(ids, at, len(self.rows), trees, backbone.device)
        flags = [False] * len(self.rows)
        for i, tree in zip(at, trees, strict=True):
            flags[i] = tree is not None
        trunk, verifier, _ = self.natives
        for i in at:
            self.base[i] = trunk.length[i] if trunk.rows else verifier.length[i]
        with torch.no_grad():
            hidden = model.embed(batch.values, None)  # (B, T, d)
            with backbone.adapter(False):
                run = (batch.counts, batch.inner, batch.offsets, flags)
                hidden = backbone.run_rows(hidden, trunk, *run)
                tail = backbone.run_rows(hidden, verifier, *run)  # (B, T, d)
        counts = [x.shape[0] for x in ids]
        return row_outputs(model, hidden, tail, at, counts, last)

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Of the last pass's positions, each row keeps a prefix or the ``(K,)`` offsets."""
        backbone = self.model.backbone
        for i, keep in zip(index_of(self.rows, rows), keeps, strict=True):
            base = self.base[i]
            for native in self.natives[:2]:
                if not len(native.layers):
                    continue
                width = native.length[i] - base
                if isinstance(keep, int):
                    if keep < width:
                        backbone.rows_select(native, i, base + keep)
                elif keep.numel() < width:
                    backbone.rows_select(native, i, base, keep)

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """The draft tail over each row's kept states ``(1, K_b, d)``: its last output
        ``(1, d)`` (a fresh row's alone, in its own caches; the others in one batch)."""
        model = self.model
        out: list[Tensor | None] = [None] * len(rows)
        batched = []
        for n, (row, kept) in enumerate(zip(rows, states, strict=True)):
            if id(row) in self.fresh:
                (out[n],) = self.fresh[id(row)][1].draft([row], [kept])  # (1, d)
            elif kept.shape[1]:
                batched.append(n)
        self._join()
        if batched:
            at = index_of(self.rows, [rows[n] for n in batched])
            values = [states[n][0] for n in batched]
            b = len(self.rows)
            batch = pad_rows(values, at, b, [None] * len(at), model.backbone.device)
            with torch.no_grad(), model.backbone.adapter(model.k > 0):
                run = (batch.counts, batch.inner, batch.offsets, [False] * b)
                tail = model.backbone.run_rows(batch.values, self.natives[2], *run)
            for i, n, x in zip(at, batched, values, strict=True):
                out[n] = tail[i : i + 1, x.shape[0] - 1]
        return out

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave the batch."""
        for row in rows:
            self.fresh.pop(id(row), None)
        gone = {id(row) for row in rows}
        stay = [i for i, row in enumerate(self.rows) if id(row) not in gone]
        if len(stay) == len(self.rows):
            return
        index = torch.tensor(stay, dtype=torch.long, device=self.model.backbone.device)
        for native in self.natives:
            if len(native.layers):
                native.take(index)
        self.rows = [self.rows[i] for i in stay]
        self.base = [self.base[i] for i in stay]
