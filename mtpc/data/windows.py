"""Overlapping prediction windows over packed sequences (paper Sec. 4.1, Eq. 4).

For position t of a packed sequence and window offset j = 1..n the target is x_{t+j}. It
is valid only when (a) t + j is inside the sequence, (b) x_{t+j} belongs to the same
document as x_t (windows never cross a document boundary) and (c) x_{t+j} is a loss byte:
an assistant byte or the end-of-turn id that closes an assistant turn. Validity is per
(t, j): a window may start on a prompt byte (the header before an answer predicts the
answer's first bytes) and may end after the answer.

The targets themselves hold the true byte wherever x_{t+j} is in the same document, loss
byte or not (``window_mask``), because the loss term of position j is the circuit's
conditional given the true bytes x_{t+1..t+j-1}: a window that starts on the header
before an answer conditions the answer's first byte on the header's last bytes. Only past
the document's end are targets padding (and marginalised by the circuit).

``V_{i,j}`` (``valid_counts``) is the number of valid targets at offset j in sequence i, the
normaliser of Eq. 4. With packing, i indexes *packed* sequences: the paper trains on "the
packed train split" and Eq. 4's N is the number of training sequences, so normalising per
packed row is the direct reading (each packed row weighs the same, its documents weigh by
their assistant bytes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def make_windows(
    input_ids: Tensor, document_ids: Tensor, loss_mask: Tensor, window: int, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Targets x_{t+1..t+n} and their validity for every position.

    Args:
        input_ids: (B, L) ids.
        document_ids: (B, L) document index per position; padding has a negative id.
        loss_mask: (B, L) True on the bytes the loss is computed on.
        window: n, the number of future bytes per position.
        pad_id: the id put where a target is invalid.

    Returns:
        ``targets`` (B, L, n) int64, ``targets[b, t, j-1] = x_{t+j}`` where x_{t+j} is in
        the same document as x_t, else ``pad_id``; ``target_mask`` (B, L, n) bool, the
        targets the loss counts (same document and a loss byte); and ``window_mask``
        (B, L, n) bool, the targets in the same document (what the circuit conditions on).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if input_ids.dim() != 2 or not input_ids.shape == document_ids.shape == loss_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, document_ids {tuple(document_ids.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must all be (B, L)"
        )
    ids = torch.nn.functional.pad(input_ids.long(), (0, window), value=pad_id)  # (B, L+n)
    docs = torch.nn.functional.pad(document_ids.long(), (0, window), value=-2)  # (B, L+n)
    loss = torch.nn.functional.pad(loss_mask.bool(), (0, window), value=False)  # (B, L+n)
    # unfold(1, n, 1)[:, t] covers positions t..t+n-1; shift by one for t+1..t+n
    future_ids = ids.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    future_docs = docs.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    future_loss = loss.unfold(1, window, 1)[:, 1:]  # (B, L, n)
    same_doc = (future_docs == document_ids.long().unsqueeze(-1)) & (
        document_ids.unsqueeze(-1) >= 0
    )
    target_mask = future_loss & same_doc  # (B, L, n)
    targets = torch.where(same_doc, future_ids, torch.full_like(future_ids, pad_id))  # (B, L, n)
    return targets.contiguous(), target_mask.contiguous(), same_doc.contiguous()


def valid_counts(target_mask: Tensor) -> Tensor:
    """V_{i,j}: valid targets per sequence and window offset; (B, L, n) -> (B, n) float32."""
    return target_mask.sum(dim=1).to(torch.float32)
