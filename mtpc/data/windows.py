"""Overlapping prediction windows over packed sequences (paper Sec. 4.1, Eq. 4).

Target j of position t is x_{t+j}; it counts for the loss when it is in x_t's document and
a loss byte. Targets hold the true byte anywhere in the document, loss byte or not: the
term of offset j is the circuit's conditional given x_{t+1..t+j-1}. V_{i,j} is per packed
sequence. See docs/DATA.md, "Batch format".
"""

from __future__ import annotations

import torch
from torch import Tensor


def make_windows(
    input_ids: Tensor, document_ids: Tensor, loss_mask: Tensor, window: int, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Targets x_{t+1..t+n} of every position and their validity; inputs are (B, L).

    ``document_ids`` is negative on padding; ``pad_id`` fills targets outside x_t's document.
    Returns ``targets`` (B, L, n) int64, ``target_mask`` (B, L, n) bool (same document and a loss
    byte) and ``window_mask`` (B, L, n) bool (same document: what the circuit conditions on).
    """
    ids = torch.nn.functional.pad(input_ids.long(), (0, window), value=pad_id)  # (B, L+n)
    docs = torch.nn.functional.pad(document_ids.long(), (0, window), value=-2)  # (B, L+n)
    loss = torch.nn.functional.pad(loss_mask.bool(), (0, window), value=False)  # (B, L+n)
    # unfold(1, n, 1)[:, t] covers positions t..t+n-1; shift by one for t+1..t+n
    future_ids = ids.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    future_docs = docs.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    future_loss = loss.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    doc = document_ids.long().unsqueeze(-1)  # (B, L, 1)
    same_doc = (future_docs == doc) & (doc >= 0)  # (B, L, n)
    target_mask = future_loss & same_doc  # (B, L, n)
    targets = torch.where(same_doc, future_ids, torch.full_like(future_ids, pad_id))  # (B, L, n)
    return targets.contiguous(), target_mask.contiguous(), same_doc.contiguous()


def valid_counts(target_mask: Tensor) -> Tensor:
    """V_{i,j}: valid targets per sequence and window offset; (B, L, n) -> (B, n) float32."""
    return target_mask.sum(dim=1).to(torch.float32)
