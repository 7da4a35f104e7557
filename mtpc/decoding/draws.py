"""A counter-based random stream per row: every uniform a decoder draws is a pure function of
(the row's seed, the cycle's first output position, the draw's slot and index), computed in
integer tensor ops for all rows at once. A row's draws then depend on nothing but its own
seed and positions: its output is the same alone, in any company, admitted first or in place
of a finished row, on CPU and CUDA. See docs/DECODING.md, "Random draws".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

DRAFT, ACCEPT, EMIT, LATENT = 0, 1, 2, 3
"""Slots: draft i's token, draft i's acceptance test, the target's token at offset i (the
correction, the bonus, a tree's choice at depth i, AR's token), the latent path's unit k."""

MASK = 0xFFFFFFFF
LANES = (0x243F6A88, 0x85A308D3)  # two 32-bit states (pi's digits): 64 bits of key
UNIT = 2.0**-53


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for ``x`` < 2^32 in int64 without overflow: ``c`` >= 2^31 enters
    as ``c - 2^32`` (the same residue), so ``|x * c|`` < 2^63; ``& MASK`` of the
    two's-complement product is the residue."""
    return (x * (c - (1 << 32) if c >= 1 << 31 else c)) & MASK


def mix(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer (Wellons' ``lowbias32``) on int64 values < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xD35A2D97)
    return x ^ (x >> 15)


def absorb(state: Tensor, word: Tensor | int) -> Tensor:
    """The state after one more 32-bit key word (a sponge: ``mix(state ^ word)``)."""
    return mix(state ^ (word & MASK))


def row_key(seed: int) -> tuple[int, int]:
    """The two lanes' states after a row's seed (its low and high 32 bits; seeds mod 2^64)."""
    state = torch.tensor(LANES, dtype=torch.long)
    for word in (seed & MASK, (seed >> 32) & MASK):
        state = absorb(state, word)
    lo, hi = state.tolist()
    return lo, hi


def uniforms(keys: Tensor, starts: Tensor, columns: Tensor) -> Tensor:
    """Uniforms in [0, 1) ``(B, k)`` float64 with 53 random bits each (the acceptance test
    compares them with p / q in float64; inverse-CDF draws over float64 cumulative sums).

    ``keys`` ``(B, 2)``: :func:`row_key` per row; ``starts`` ``(B,)``: each row's cycle's
    first output position; ``columns`` ``(k,)`` or per row ``(B, k)``: ``slot << 16 | index``
    per draw.
    """
    state = keys.T[:, :, None]  # (2, B, 1)
    state = absorb(state, starts[None, :, None])
    state = absorb(state, columns.expand(starts.shape[0], -1)[None])  # (2, B, k)
    state = mix(state ^ torch.tensor([[[1]], [[2]]], device=state.device))  # lanes apart
    bits = ((state[0] >> 5) << 26) | (state[1] >> 6)  # (B, k) < 2^53
    return bits.double() * UNIT


def columns(slot: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """The columns ``(count,)`` of draws 0..count-1 of one slot."""
    return (slot << 16) | torch.arange(count, device=device)


class Draws:
    """The stream of one cycle's rows: their keys (:func:`row_key`) and ``starts``, the output
    position of each row's first token this cycle (every cycle emits at least one token, so a
    row never meets the same (start, slot, index) twice). ``counts``: the draws per slot a
    cycle may read, hashed in one table at the first read (a greedy cycle reads none)."""

    def __init__(
        self,
        keys: Sequence[tuple[int, int]],
        starts: Sequence[int],
        device: torch.device,
        counts: Mapping[int, int] | None = None,
    ) -> None:
        self._rows = [[*k, s] for k, s in zip(keys, starts, strict=True)]
        self.device = device
        self.counts = dict(counts or {})
        self._blocks: dict[int, Tensor] | None = None

    def _hash(self, cols: Tensor) -> Tensor:
        """:func:`uniforms` of every row at ``cols`` ``(k,)`` or ``(B, k)``."""
        table = torch.tensor(self._rows, dtype=torch.long, device=self.device)  # (B, 3)
        return uniforms(table[:, :2], table[:, 2], cols)

    def _block(self, slot: int) -> Tensor:
        """Draws 0..counts[slot]-1 of ``slot`` ``(B, counts[slot])`` (the table's)."""
        if self._blocks is None:
            cols = torch.cat([columns(s, c, self.device) for s, c in self.counts.items()])
            table = self._hash(cols).split(list(self.counts.values()), 1)
            self._blocks = dict(zip(self.counts, table, strict=True))
        return self._blocks[slot]

    def take(self, slot: int, count: int) -> Tensor:
        """Draws 0..count-1 of ``slot`` for every row ``(B, count)``."""
        if count <= self.counts.get(slot, -1):
            return self._block(slot)[:, :count]
        return self._hash(columns(slot, count, self.device))

    def at(self, slot: int, index: Tensor) -> Tensor:
        """Draw ``index[b]`` of ``slot`` for each row b ``(B,)`` (index ``(B,)``; in the table
        when ``slot`` is: then below its count)."""
        if slot in self.counts:
            return self._block(slot).gather(1, index[:, None])[:, 0]
        return self._hash(((slot << 16) | index)[:, None])[:, 0]
