"""EvaByte on the static engine (``compile=`` with an ``EvaByteBackbone``): its EVA windows
and chunk RFAs in fixed buffers, which slots and which RFAs a query sees as masks computed
from the rows' lengths, and the window compression as a fixed-shape RFA update of the chunks
each pass touches. See docs/DECODING.md, "EvaByte on the engine".

Per layer ONE key and one value buffer ``(B, h, S, hd)``, ``S = F + R + X``:

- slots ``[0, F)``: chunk q's RFA in slot q (``F = ceil(capacity / c) + 1``; the last slot
  takes the RFAs of chunks past the capacity, which no query sees);
- slots ``[F, F + R)``: the window ring, position p's key in slot ``F + p mod R`` (``R = W +
  X``, W the EVA window: a pass's new keys land on positions at least W + 1 before its
  first, which none of its queries nor any later one sees; a token tree's nodes in pass
  order until :meth:`EvaStaticEngine.compact`);
- slots ``[F + R, S)``: the scratch, the padding ids' keys (``X``: the widest pass).

A query at position p (its window starting at ``s = p - p mod W``) sees RFA q iff chunk q
ends at or before s (``(q + 1) c <= s``), the ring slots holding positions ``[s, length)``
of its row, and the pass's new ids ``inner`` allows (in its own window). Each layer of a pass
writes its new keys, recomputes from the ring the RFAs of every chunk its positions touch
(an incomplete chunk's is seen by nobody until the pass completing it), then attends: so a
window boundary inside a pass is handled as the eager path's two pieces handle it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from mtpc.backbones.evabyte import refresh_rfas
from mtpc.decoding.static_step import StaticEngine


class Rotary(NamedTuple):
    """The remote rotary table of positions ``[0, N)``: ``cos``, ``sin`` ``(N, hd)``."""

    cos: Tensor
    sin: Tensor


class EvaSlots:
    """The fixed buffers of layers ``first..`` (the module docstring's layout) and the
    current pass's indices (set by :meth:`EvaStaticEngine._prepare`, read by
    ``evabyte.static_attention``).

    ``keys[l - first]``, ``values[l - first]``: layer l's ``(B, h, S, hd)``; ``rfas`` (F),
    ``ring`` (R), ``chunk`` (c), ``window`` (W); ``rows``: ``arange(B)``; per pass:
    ``slots`` ``(B, T)`` the new ids' buffer slots, ``chunk_read`` ``(B, n c)`` the slots of
    the n touched chunks' positions, ``chunk_write`` ``(B, n)`` their RFA slots.
    """

    def __init__(
        self, keys: list[Tensor], values: list[Tensor], first: int, rfas: int, ring: int,
        chunk: int, window: int, rotary: Rotary,
    ) -> None:  # fmt: skip
        self.keys, self.values, self.first = keys, values, first
        self.rfas, self.ring, self.chunk, self.window = rfas, ring, chunk, window
        self.rotary = rotary
        self.rows = torch.arange(keys[0].shape[0], device=keys[0].device)
        self.slots: Tensor | None = None
        self.chunk_read: Tensor | None = None
        self.chunk_write: Tensor | None = None


def chunk_slots(cache: Any, first: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ring slots ``(R, n c)`` of the positions of ``n`` chunks from chunk ``first``
    ``(R,)`` per row, and their RFA slots ``(R, n)`` (chunks past the capacity: the last)."""
    chunks = first[:, None] + torch.arange(n, device=first.device)  # (R, n)
    at = chunks[:, :, None] * cache.chunk + torch.arange(cache.chunk, device=first.device)
    return cache.rfas + (at % cache.ring).flatten(1), chunks.clamp(max=cache.rfas - 1)


class EvaStaticEngine(StaticEngine):
    """:class:`StaticEngine` over an EvaByte target: the same step, layout and compile, its
    caches :class:`EvaSlots` (``valid`` unused: what a row holds follows from its length)."""

    def _buffers(self, first: int, end: int) -> tuple[Any, Tensor, Tensor]:
        backbone = self.model.backbone
        w, c = int(backbone.config.window_size), int(backbone.config.chunk_size)
        ring = w + self.widest
        rfas = -(-self.capacity // c) + 1
        self.slots = rfas + ring + self.widest
        cache, valid, lengths = super()._buffers(first, end)
        if not hasattr(self, "rotary"):  # positions up to the capacity and a padded pass
            self.rotary = Rotary(*backbone.rotary_table(self.capacity + 2 * self.widest))
        slots = EvaSlots(cache.keys, cache.values, first, rfas, ring, c, w, self.rotary)
        return slots, valid[:, :0], lengths

    def rewind(self, lengths: Tensor) -> None:
        """Every row keeps its first ``lengths`` ``(B,)`` positions: the ring slots past them
        are seen by nobody (a query sees positions below its row's length) and the next pass
        writes over them; the RFAs of chunks they touch are recomputed when completed."""
        self.lengths.copy_(lengths)

    def _prepare(
        self, cache: Any, valid: Tensor, lengths: Tensor, real: Tensor, offsets: Tensor,
        inner: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sets the pass's slots on ``cache``; the positions ``(B, T)`` and the visibility
        ``(B, T, S)`` over ``[RFAs | ring | scratch]`` (the module docstring's rule)."""
        b, t = real.shape
        device = real.device
        f, ring, c, w = cache.rfas, cache.ring, cache.chunk, cache.window
        span = torch.arange(t, device=device)  # (T,)
        positions = lengths[:, None] + offsets  # (B, T): a tree node's, its depth's
        slots = torch.where(real, (lengths[:, None] + span) % ring, ring + span)  # past the RFAs
        top = lengths + real.sum(1)  # (B,) the rows' lengths after the pass
        ring_at = torch.arange(ring, device=device)  # (R,)
        held = top[:, None] - 1 - (top[:, None] - 1 - ring_at) % ring  # (B, R) slot's position
        start = positions - positions % w  # (B, T) each query's window start
        new = torch.zeros(b, t, self.slots - f, dtype=torch.bool, device=device)
        new.scatter_(2, slots[:, None, :].expand(b, t, t), inner)  # (B, T, R + X)
        in_window = held[:, None, :] >= start[:, :, None]  # (B, T, R)
        kept = (held < lengths[:, None])[:, None, :]  # (B, 1, R) held before the pass
        seen_ring = in_window & (kept | new[..., :ring])
        chunk_end = (torch.arange(f, device=device) + 1) * c  # (F,)
        seen_rfas = chunk_end[None, None, :] <= start[:, :, None]  # (B, T, F)
        seen = torch.cat([seen_rfas, seen_ring, new[..., ring:]], 2)  # (B, T, S)
        n = -(-(t - 1) // c) + 1  # chunks a pass of T positions can touch
        cache.chunk_read, cache.chunk_write = chunk_slots(cache, lengths // c, n)
        cache.slots = f + slots
        return positions.clamp(max=cache.rotary.cos.shape[0] - 1), seen

    def compact(self, places: Tensor, base: Tensor, keep: Tensor) -> None:
        """:meth:`StaticEngine.compact` in the window ring (offset j of a pass is in slot ``F +
        (base + j) mod R``), then the RFAs of the chunks the kept positions touch recomputed
        from it (the tree pass summarised its nodes in pass order: a chunk the accepted path
        completes is read by no later pass)."""
        cache: Any = self.cache
        rows = places[:, None]  # (R, 1)
        f, ring, c = cache.rfas, cache.ring, cache.chunk
        count = keep.shape[1]
        src = f + (base[:, None] + keep) % ring  # (R, K)
        dst = f + (base[:, None] + torch.arange(count, device=keep.device)) % ring
        for buffer in (*cache.keys, *cache.values):  # (B, h, S, hd) each
            buffer[rows, :, dst] = buffer[rows, :, src]  # (R, K, h, hd): gathered first
        self._refresh(cache, rows, base // c, -(-(count - 1) // c) + 1)  # chunks K can touch

    def _refresh(self, cache: Any, rows: Tensor, first: Tensor, n: int) -> None:
        """Recomputes from the ring, in every layer of ``cache``, the RFAs of the ``n``
        chunks from chunk ``first`` ``(R,)`` of the rows ``rows`` ``(R, 1)`` (as a pass does,
        ``evabyte.refresh_rfas``)."""
        read, write = chunk_slots(cache, first, n)
        layers = self.model.backbone.layers
        for i, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            refresh_rfas(layers[cache.first + i].self_attn, keys, values, rows, read, write)

    def adopt(self, place: int, caches: Any) -> None:
        """Row ``place`` takes a one-row ``layout.Stream``'s caches (its prompt prefilled
        alone: an uncompiled engine's admission, which would otherwise run B rows per prefill
        chunk): trunk and verifier into the target buffers, the draft tail's into cache D,
        each window's positions into the ring and its RFAs into their slots; the RFAs of the
        current window's chunks are computed as a pass computes them."""
        backbone = self.model.backbone
        targets: list[tuple[Any, Tensor, tuple[Any, ...]]] = [
            (self.cache, self.lengths, (caches.trunk, caches.verifier))
        ]
        if self.model.k:
            self._draft_buffers()
            targets.append((self.draft_cache, self.draft_lengths, (caches.draft,)))
        rows = torch.tensor([[place]], device=self.device)  # (1, 1)
        for cache, lengths, parts in targets:
            length = start = 0
            for native in (part.native for part in parts if part.native is not None):
                backbone._settle(native)  # trunk and verifier: the same positions
                length, start = native.length, native.window_start
                span = torch.arange(length - start, device=self.device)
                window = cache.rfas + (start + span) % cache.ring  # its window's ring slots
                for layer in native.layers:
                    i = layer - cache.first
                    for mine, ring_kv, rfa in (
                        (cache.keys[i], native.past_window_k[layer], native.rfa_k[layer]),
                        (cache.values[i], native.past_window_v[layer], native.rfa_v[layer]),
                    ):
                        mine[place][:, window] = ring_kv[0, :, : length - start].to(mine.dtype)
                        if rfa is not None:
                            mine[place][:, : rfa.shape[2]] = rfa[0].to(mine.dtype)
            first = torch.tensor([start // cache.chunk], device=self.device)
            self._refresh(cache, rows, first, -(-(length - start) // cache.chunk))  # its window's
            lengths[place] = length

    @staticmethod
    def _append(cache: Any, valid: Tensor, lengths: Tensor, real: Tensor) -> None:
        lengths.add_(real.sum(1))
