"""Where the rows of one decoding call keep their caches: one stream, or one padded batch.

A layout runs ``target`` (ONE trunk + verifier-tail pass over each row's new ids, a chain or
a token tree), ``keep`` (drops the rejected positions), ``draft`` (the draft tail over the
kept states) and ``release`` (finished rows leave). :class:`Stream`: one row in the model's
own caches (every backbone); :class:`Padded`: B rows in one batched cache, each reading only
its own slots (:class:`Slots`). See docs/DECODING.md, "Many prompts at once".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

Tree = tuple[Tensor, Tensor] | None
"""A pass's layout for one row: a token tree's ``(depth (T,), mask (T, T))``; None: a chain."""


def index_of(held: Sequence[Any], rows: Sequence[Any]) -> list[int]:
    """Where each of ``rows`` is in ``held`` (by identity)."""
    at = {id(row): i for i, row in enumerate(held)}
    return [at[id(row)] for row in rows]


class Batch(NamedTuple):
    """Rows' new positions padded into one batch (:func:`pad_rows`)."""

    values: Tensor  # (B, T, ...) each row's values, zeros past them and in rows sitting out
    real: Tensor  # (B, T) bool: the rows' own positions
    offsets: Tensor  # (B, T) position after the row's length: a chain's 0..T-1, a tree's depth
    inner: Tensor  # (B, T, T) bool, new sees new: a chain causal, a tree its mask, padding itself
    counts: list[int]  # (B,) each row's new positions (0: it sits out)


def pad_rows(
    values: Sequence[Tensor], at: Sequence[int], b: int, trees: Sequence[Tree], device: Any
) -> Batch:
    """The rows' ``values`` ((T_r, ...) each) at batch rows ``at`` of a batch of ``b`` rows,
    T the longest."""
    width = max(x.shape[0] for x in values)
    padded = torch.zeros(b, width, *values[0].shape[1:], dtype=values[0].dtype, device=device)
    real = torch.zeros(b, width, dtype=torch.bool, device=device)
    offsets = torch.arange(width, device=device).repeat(b, 1)
    inner = torch.eye(width, dtype=torch.bool, device=device).repeat(b, 1, 1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    counts = [0] * b
    for i, x, tree in zip(at, values, trees, strict=True):
        t = counts[i] = x.shape[0]
        padded[i, :t], real[i, :t] = x, True
        if tree is None:
            inner[i, :t, :t] = causal[:t, :t]
        else:
            offsets[i, :t], inner[i, :t, :t] = tree
    return Batch(padded, real, offsets, inner, counts)


class Stream:
    """One row in the model's own caches (``MTPCModel.new_caches``): batch size 1."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches = model.new_caches()

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills the one row's prompt ``(T,)``: its trunk states ``(1, T, d)`` and its last
        position's target logits ``(1, V)``."""
        if len(rows) != 1 or len(self.caches.trunk):
            raise ValueError("a stream holds one row at a time")
        return self.target(rows, prompts, [None], last=True)

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Tree], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Trunk + verifier tail on the row's ``ids`` (T,); ``last``: logits of the last
        position only (a prefill)."""
        (row_ids,), (tree,) = ids, trees
        model, caches = self.model, self.caches
        self.base = len(caches.trunk)
        kw = {} if tree is None else {"positions": self.base + tree[0], "tree_mask": tree[1]}
        hidden = model.trunk(row_ids[None], caches.trunk, **kw)  # (1, T, d)
        tail = model.verifier_tail(hidden, caches.verifier, **kw)  # (1, T, d)
        logits = model.verifier_logits(tail[0, -1:] if last else tail[0])  # (T, V)
        return [hidden], [logits]

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Crops the pass to a prefix of ``keep`` positions, or compacts it to ``keep``."""
        (keep,) = keeps
        caches = self.caches
        if isinstance(keep, int):  # the draft tail's cache is never past the pass's base
            caches.crop(self.base + keep)
        elif keep.numel() < len(caches.trunk) - self.base:
            caches.compact(self.base, keep)

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """The draft tail over the row's kept states ``(1, K, d)``: its last output ``(1, d)``."""
        if not states:  # the row is done
            return []
        (kept,) = states
        if not kept.shape[1]:
            return [None]
        return [self.model.draft_tail(kept, self.caches.draft)[:, -1]]  # (1, d)

    def release(self, rows: Sequence[Any]) -> None:
        """Empties the caches for the next row."""
        if rows and len(self.caches.trunk):
            self.caches.reset()


class Slots:
    """Which physical slots of a batched component cache hold which row's positions.

    ``caches``: the components sharing this layout (trunk and verifier tail see the same
    positions; the draft tail has its own). A row's slots are its own: a rejected draft's, a
    padding or a left row's slot is never valid for another row.
    """

    slack = 16
    """Holes allowed beyond a quarter of the longest row before the rows are packed."""

    def __init__(self, model: Any, caches: Sequence[Any]) -> None:
        self.backbone = model.backbone
        self.caches = list(caches)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=model.backbone.device)  # (B, P)

    @property
    def lengths(self) -> Tensor:
        """Each row's own cache length ``(B,)``."""
        return self.valid.sum(1)

    def layout(self, offsets: Tensor, inner: Tensor) -> tuple[Tensor, Tensor]:
        """Positions ``(B, T)`` and visibility ``(B, T, P + T)`` of T new slots per row, given
        ``offsets`` ``(B, T)`` from each row's length (a chain's 0..T-1, a tree node's depth)
        and ``inner`` ``(B, T, T)`` bool: which new positions each new one sees."""
        b, t = offsets.shape
        if not self.valid.shape[0]:  # a fresh batch
            self.valid = self.valid.new_zeros(b, 0)
        seen = self.valid[:, None, :].expand(-1, t, -1)  # (B, T, P)
        return self.lengths[:, None] + offsets, torch.cat([seen, inner], 2)

    def appended(self, real: Tensor) -> None:
        """The pass appended ``real.shape[1]`` slots; ``real`` ``(B, T)``: the rows' own."""
        self.valid = torch.cat([self.valid, real], 1)

    def history(self, row: int) -> Tensor | None:
        """Row ``row``'s own id history ``(1, L)`` (the byte Llama's embedding reads it)."""
        ids = self.caches[0].ids
        return None if ids is None else ids[row, self.valid[row]][None]

    def keep(self, base: int, keep: Tensor) -> None:
        """Of the slots from ``base`` on, keeps those in ``keep`` ``(B, W)`` bool; crops the
        slots no row holds at the end, packs the rows when the holes grow."""
        self.valid[:, base:] &= keep
        held = self.valid.any(0).nonzero()
        end = int(held[-1]) + 1 if held.numel() else 0
        if end < self.valid.shape[1]:
            for cache in self.caches:
                cache.crop(end)
            self.valid = self.valid[:, :end]
        longest = int(self.lengths.max()) if self.valid.shape[0] else 0
        if self.valid.shape[1] > longest + longest // 4 + self.slack:
            self.take(torch.arange(self.valid.shape[0], device=self.valid.device))

    def take(self, rows: Tensor) -> None:
        """Keeps the rows ``rows`` ``(B',)`` in that order, each packed to the left."""
        if not self.valid.shape[0]:  # nothing cached yet (the draft tail of an AR batch)
            return
        valid = self.valid.index_select(0, rows)  # (B', P)
        width = int(valid.sum(1).max()) if rows.numel() else 0
        # row i's valid slot indices first (stable), then anything (masked out) up to width
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for cache in self.caches:
            if cache.native is not None:
                self.backbone.native_take(cache.native, rows, order)
            if cache.ids is not None:
                cache.ids = cache.ids.index_select(0, rows).gather(1, order)
            cache.length = width
        self.valid = valid.gather(1, order)

    def merge(self, other: Slots) -> None:
        """Appends the rows of ``other`` (another batch of the same components)."""
        if not self.valid.shape[0]:
            for cache, add in zip(self.caches, other.caches, strict=True):
                cache.native, cache.ids, cache.length = add.native, add.ids, add.length
            self.valid = other.valid
            return
        width = max(self.valid.shape[1], other.valid.shape[1])
        for slots in (self, other):
            slots.pad(width)
        for cache, add in zip(self.caches, other.caches, strict=True):
            if cache.native is not None:
                self.backbone.native_merge(cache.native, add.native)
            if cache.ids is not None:
                cache.ids = torch.cat([cache.ids, add.ids])
        self.valid = torch.cat([self.valid, other.valid])

    def grow(self, count: int) -> None:
        """Appends ``count`` rows holding no slot (their places copy row 0's, never read)."""
        b, p = self.valid.shape
        if not b:  # nothing cached yet: the rows start with the first pass
            return
        rows = torch.cat([torch.arange(b), torch.zeros(count, dtype=torch.long)])
        rows = rows.to(self.valid.device)
        index = torch.arange(p, device=self.valid.device).expand(b + count, p)
        for cache in self.caches:
            if cache.native is not None:
                self.backbone.native_take(cache.native, rows, index)
            if cache.ids is not None:
                cache.ids = cache.ids.index_select(0, rows)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(count, p)])

    def pad(self, width: int) -> None:
        """Appends empty slots up to ``width``."""
        extra = width - self.valid.shape[1]
        if extra <= 0:
            return
        for cache in self.caches:
            if cache.native is not None:
                self.backbone.native_pad(cache.native, width)
            if cache.ids is not None:
                cache.ids = torch.nn.functional.pad(cache.ids, (0, extra))
            cache.length = width
        self.valid = torch.nn.functional.pad(self.valid, (0, extra))


class Padded:
    """B rows, in ``rows``' order, in one set of caches with a batch dimension
    (``supports_batch`` backbones); :meth:`admit` adds rows, :meth:`release` removes them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches = model.new_caches()
        self.target_slots = Slots(model, [self.caches.trunk, self.caches.verifier])
        self.draft_slots = Slots(model, [self.caches.draft])
        self.rows: list[Any] = []

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills ``prompts`` ((T_b,) each) as new rows; returns the rows' trunk states
        ``(1, T_b, d)`` and their last position's target logits ``(1, V)``."""
        batch = Padded(self.model)  # prefilled apart, then merged (the first: adopted)
        batch.rows = list(rows)
        out = batch.target(rows, prompts, [None] * len(rows), last=True)
        self.target_slots.merge(batch.target_slots)
        self.draft_slots.grow(len(rows))
        self.rows += rows
        return out

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Tree], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One batched trunk + verifier-tail pass over every held row (``rows`` must be all of
        them, in any order): the rows' trunk states ``(1, T_b, d)`` and logits ``(T_b, V)``
        (``last``: at each row's last position only, ``(1, V)``)."""
        model, slots = self.model, self.target_slots
        order = index_of(self.rows, rows)
        batch = pad_rows(ids, order, len(self.rows), trees, model.backbone.device)
        positions, attend = slots.layout(batch.offsets, batch.inner)
        hidden = self._embed(batch.values, ids, trees, order)
        self.base = slots.valid.shape[1]
        hidden = model.trunk(
            batch.values, self.caches.trunk, positions, attend=attend, hidden=hidden
        )
        tail = model.verifier_tail(hidden, self.caches.verifier, positions, attend=attend)
        slots.appended(batch.real)
        counts = [x.shape[0] for x in ids]
        if last:  # each row's last position (R, d): one row of logits each
            out = model.verifier_logits(tail[order, [t - 1 for t in counts]])[:, None]  # (R, 1, V)
        else:
            out = model.verifier_logits(tail[order])  # (R, T, V)
        states = [hidden[i : i + 1, :t] for i, t in zip(order, counts, strict=True)]
        return states, [o[: 1 if last else t] for o, t in zip(out, counts, strict=True)]

    def _embed(
        self, padded: Tensor, ids: Sequence[Tensor], trees: Sequence[Tree], order: list[int]
    ) -> Tensor:
        """The new ids' embeddings ``(B, T, d)``; a row at a time when the embedding reads
        the row's own history (the byte Llama)."""
        model = self.model
        if not model.backbone.needs_history:
            return model.embed(padded, None)
        hidden = model.embed(padded, None).clone()  # padding rows keep any embedding
        for i, x, tree in zip(order, ids, trees, strict=True):
            past = self.target_slots.history(i)
            mask = None if tree is None else tree[1]
            hidden[i : i + 1, : x.shape[0]] = model.embed(x[None], past, mask)
        return hidden

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Of the last pass's slots, each row keeps a prefix or the ``(K,)`` offsets."""
        slots = self.target_slots
        width = slots.valid.shape[1] - self.base
        keep = torch.zeros(len(self.rows), width, dtype=torch.bool, device=slots.valid.device)
        for i, k in zip(index_of(self.rows, rows), keeps, strict=True):
            if isinstance(k, int):
                keep[i, :k] = True
            else:
                keep[i, k] = True
        slots.keep(self.base, keep)

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """One batched draft-tail pass over each row's kept states ``(1, K_b, d)``."""
        slots, model = self.draft_slots, self.model
        width = max((s.shape[1] for s in states), default=0)
        if not width:
            return [None] * len(rows)
        order = index_of(self.rows, rows)
        kept = [s[0] for s in states]
        batch = pad_rows(kept, order, len(self.rows), [None] * len(rows), model.backbone.device)
        positions, attend = slots.layout(batch.offsets, batch.inner)
        out = model.draft_tail(batch.values, self.caches.draft, positions, attend=attend)
        slots.appended(batch.real)
        slots.keep(slots.valid.shape[1] - width, batch.real)
        return [out[i : i + 1, s.shape[1] - 1] if s.shape[1] else None
                for i, s in zip(order, states, strict=True)]  # fmt: skip

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave the batch (their slots with them)."""
        gone = {id(row) for row in rows}
        stay = [i for i, row in enumerate(self.rows) if id(row) not in gone]
        if len(stay) == len(self.rows):  # nothing held (or released already)
            return
        if not stay:  # a fresh batch for the next admissions
            self.__init__(self.model)  # type: ignore[misc]
            return
        index = torch.tensor(stay, device=self.model.backbone.device)
        self.target_slots.take(index)
        self.draft_slots.take(index)
        self.rows = [self.rows[i] for i in stay]
