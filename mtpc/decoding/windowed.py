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

from mtpc.decoding.layout import Tree


class Windowed:
    """B rows, in ``rows``' order, in one :class:`EvaRowsCache` per component (trunk,
    verifier tail, draft tail); rows admitted but not yet in it wait in ``fresh``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        backbone, split, n = model.backbone, model.split, model.backbone.num_layers
        self.natives = [
            backbone.new_rows_cache(0, split),
            backbone.new_rows_cache(split, n),
            backbone.new_rows_cache(split, n),
        ]  # trunk, verifier tail, draft tail
        self.rows: list[Any] = []
        self.fresh: dict[int, tuple[Any, Any]] = {}  # id(row) -> (row, its one-row caches)
        self.base: list[int] = []  # each row's length before the last target pass

    def _index(self, rows: Sequence[Any]) -> list[int]:
        at = {id(row): i for i, row in enumerate(self.rows)}
        return [at[id(row)] for row in rows]

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills each prompt ``(T_b,)`` alone; returns the rows' trunk states ``(1, T_b,
        d)`` and their last position's target logits ``(1, V)``."""
        model = self.model
        states, logits = [], []
        for row, prompt in zip(rows, prompts, strict=True):
            caches = model.new_caches()
            hidden = model.trunk(prompt[None], caches.trunk)  # (1, T, d)
            tail = model.verifier_tail(hidden, caches.verifier)
            states.append(hidden)
            logits.append(model.verifier_logits(tail[0, -1:]))  # (1, V)
            self.fresh[id(row)] = (row, caches)
        return states, logits

    def _join(self) -> None:
        """The fresh rows join the batch (their one-row caches settled and appended)."""
        backbone = self.model.backbone
        for row, caches in self.fresh.values():
            for native, cache in zip(self.natives, caches, strict=True):
                if len(native.layers):
                    backbone._settle(cache.native)
                    native.append(cache.native)
            self.rows.append(row)
            self.base.append(0)
        self.fresh = {}

    def _run(
        self, native: Any, hidden: Tensor, at: list[int], counts: list[int], trees: Sequence[Tree]
    ) -> tuple[Tensor, list[int]]:
        """Scatters the rows' ``hidden`` into a (B, T, d) batch and runs ``native``'s layers."""
        b, device = len(self.rows), hidden.device
        width = hidden.shape[1]
        full = hidden.new_zeros(b, width, hidden.shape[2])
        full[at] = hidden
        rows_counts = [0] * b
        inner = torch.eye(width, dtype=torch.bool, device=device).repeat(b, 1, 1)
        offsets = torch.arange(width, device=device).repeat(b, 1)
        flags = [False] * b
        for i, count, tree in zip(at, counts, trees, strict=True):
            rows_counts[i] = count
            if tree is not None:
                flags[i] = True
                offsets[i, :count], inner[i, :count, :count] = tree
        out = self.model.backbone.run_rows(full, native, rows_counts, inner, offsets, flags)
        return out[at], rows_counts

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Tree], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One batched trunk + verifier-tail pass over ``rows``' ``ids`` (T_b,), chains or
        token trees; the other rows sit out. ``last``: logits at each last position only."""
        self._join()
        model, backbone = self.model, self.model.backbone
        at = self._index(rows)
        counts = [x.shape[0] for x in ids]
        width = max(counts)
        padded = torch.zeros(len(rows), width, dtype=torch.long, device=backbone.device)
        for i, x in enumerate(ids):
            padded[i, : x.shape[0]] = x
        trunk, verifier, _ = self.natives
        for i in at:
            self.base[i] = trunk.length[i] if trunk.rows else verifier.length[i]
        with torch.no_grad():
            hidden = model.embed(padded, None)  # (R, T, d)
            with backbone.adapter(False):
                hidden, _ = self._run(trunk, hidden, at, counts, trees)
                tail, _ = self._run(verifier, hidden, at, counts, trees)
        if last:
            ends = torch.tensor([t - 1 for t in counts], device=backbone.device)
            out = model.verifier_logits(tail[torch.arange(len(rows)), ends])[:, None]
        else:
            out = model.verifier_logits(tail)  # (R, T, V)
        states = [hidden[i : i + 1, :t] for i, t in enumerate(counts)]
        logits = [o[: 1 if last else t] for o, t in zip(out, counts, strict=True)]
        return states, logits

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Of the last pass's positions, each row keeps a prefix or the ``(K,)`` offsets."""
        backbone = self.model.backbone
        for i, keep in zip(self._index(rows), keeps, strict=True):
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
                if kept.shape[1]:
                    draft = self.fresh[id(row)][1].draft
                    out[n] = model.draft_tail(kept, draft)[:, -1]  # (1, d)
            elif kept.shape[1]:
                batched.append(n)
        self._join()
        if batched:
            at = self._index([rows[n] for n in batched])
            counts = [states[n].shape[1] for n in batched]
            width = max(counts)
            hidden = states[batched[0]].new_zeros(len(batched), width, states[0].shape[2])
            for i, n in enumerate(batched):
                hidden[i, : counts[i]] = states[n][0]
            with torch.no_grad(), model.backbone.adapter(model.k > 0):
                tail, _ = self._run(self.natives[2], hidden, at, counts, [None] * len(at))
            for i, n in enumerate(batched):
                out[n] = tail[i : i + 1, counts[i] - 1]
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
