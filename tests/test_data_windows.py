"""Window targets, masks and V_{i,j} on hand-built packed sequences; packing plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpc.data.packing import build_sequence, plan_packing
from mtpc.data.windows import make_windows, valid_counts

PAD = 0


def _brute_force(ids, docs, loss, n):
    batch, length = ids.shape
    targets = torch.full((batch, length, n), PAD, dtype=torch.int64)
    mask = torch.zeros(batch, length, n, dtype=torch.bool)
    for b in range(batch):
        for t in range(length):
            for j in range(1, n + 1):
                s = t + j
                if s < length and docs[b, t] >= 0 and docs[b, s] == docs[b, t]:
                    targets[b, t, j - 1] = ids[b, s]
                    mask[b, t, j - 1] = bool(loss[b, s])
    return targets, mask


def test_windows_on_a_packed_sequence_with_a_boundary() -> None:
    # doc 0: prompt 11 12, answer 13 14 | doc 1: prompt 21, answer 22 23 | pad
    ids = torch.tensor([[11, 12, 13, 14, 21, 22, 23, PAD]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    loss = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    targets, mask, in_doc = make_windows(ids, docs, loss, window=3, pad_id=PAD)
    assert targets.shape == (1, 8, 3) and mask.dtype == torch.bool
    # t = 1 (byte 12): x2 = 13, x3 = 14 valid; x4 = 21 is the next document
    assert targets[0, 1].tolist() == [13, 14, PAD] and mask[0, 1].tolist() == [True, True, False]
    # t = 3 (last byte of doc 0): nothing, the window would cross into doc 1
    assert not mask[0, 3].any() and targets[0, 3].tolist() == [PAD, PAD, PAD]
    # t = 4 (prompt byte of doc 1): 22, 23 valid, then padding
    assert targets[0, 4].tolist() == [22, 23, PAD] and mask[0, 4].tolist() == [True, True, False]
    # t = 0: x1 = 12 is a prompt byte (not a loss target, but the true byte that the
    # circuit conditions x2 = 13 on), x2 = 13, x3 = 14 valid
    assert mask[0, 0].tolist() == [False, True, True]
    assert targets[0, 0].tolist() == [12, 13, 14] and in_doc[0, 0].all()
    assert in_doc[0, 1].tolist() == [True, True, False]
    assert not mask[0, 6:].any()
    expected_t, expected_m = _brute_force(ids, docs, loss, 3)
    assert torch.equal(targets, expected_t) and torch.equal(mask, expected_m)
    # V_{i,j}: j=1 -> t in {1, 2, 4, 5}; j=2 -> {0, 1, 4}; j=3 -> {0}
    assert valid_counts(mask).tolist() == [[4.0, 3.0, 1.0]]


@pytest.mark.parametrize("window", [1, 4, 9])
def test_windows_match_brute_force(window: int) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 20), generator=g)
    cuts = torch.sort(torch.randint(0, 20, (3, 3), generator=g), dim=1).values
    positions = torch.arange(20)
    docs = (positions[None, :, None] >= cuts[:, None, :]).sum(-1)  # (3, 20)
    docs[:, 17:] = -1  # padding tail
    loss = torch.rand(3, 20, generator=g) < 0.6
    loss[:, 17:] = False
    targets, mask, in_doc = make_windows(ids, docs, loss, window, PAD)
    expected_t, expected_m = _brute_force(ids, docs, loss, window)
    assert torch.equal(targets, expected_t) and torch.equal(mask, expected_m)
    assert torch.equal(in_doc, expected_t != PAD)
    assert torch.equal(valid_counts(mask), expected_m.sum(1).float())


def test_packing_covers_every_id_once_and_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 70, size=300)
    lengths[:3] = [64, 150, 200]  # exactly full, and two documents cut into pieces
    plan = plan_packing(lengths, 64)
    again = plan_packing(lengths, 64)
    for a, b in zip(plan.to_arrays().values(), again.to_arrays().values(), strict=True):
        assert np.array_equal(a, b)
    per_seq = np.add.reduceat(plan.seg_len, plan.seq_offsets[:-1])
    assert per_seq.max() <= 64
    covered = {d: np.zeros(n, dtype=int) for d, n in enumerate(lengths)}
    for d, s, n in zip(plan.seg_doc, plan.seg_start, plan.seg_len, strict=True):
        covered[int(d)][s : s + n] += 1
    assert all((c == 1).all() for c in covered.values())
    assert plan.fill_ratio() > 0.95  # best-fit decreasing wastes little
    assert np.ceil(lengths.sum() / 64) <= plan.num_sequences


def test_build_sequence_restarts_positions_per_document() -> None:
    lengths = np.array([3, 2, 4])
    offsets = np.array([0, 3, 5])
    ids = np.arange(100, 109, dtype=np.uint16)
    assistant = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=bool)
    plan = plan_packing(lengths, 10)
    assert plan.num_sequences == 1
    seq = build_sequence(plan, 0, ids, assistant, offsets, np.array([0, 1, 2]), pad_id=PAD)
    docs = seq["document_ids"]
    assert (docs[9:] == -1).all() and seq["input_ids"][9] == PAD
    for local in range(3):
        where = np.flatnonzero(docs == local)
        assert (seq["position_ids"][where] == np.arange(len(where))).all()
    order = plan.seg_doc.tolist()  # longest first
    assert order == [2, 0, 1]
    assert seq["input_ids"][:4].tolist() == [105, 106, 107, 108]
    assert seq["loss_mask"][:4].tolist() == [False, False, True, True]
    assert seq["source_ids"][:9].tolist() == [2] * 4 + [0] * 3 + [1] * 2


def test_one_document_per_sequence_when_packing_is_off() -> None:
    """pack=False (EvaByte): every sequence holds one document or one piece of a long one."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 70, size=300)
    lengths[:2] = [64, 150]
    plan = plan_packing(lengths, 64, pack=False)
    assert (np.diff(plan.seq_offsets) == 1).all()  # one segment per sequence
    pieces = int(np.ceil(lengths / 64).sum())  # the 150-id document is cut into 64 + 64 + 22
    assert plan.num_sequences == pieces
    covered = {d: np.zeros(n, dtype=int) for d, n in enumerate(lengths)}
    for d, s, n in zip(plan.seg_doc, plan.seg_start, plan.seg_len, strict=True):
        covered[int(d)][s : s + n] += 1
    assert all((c == 1).all() for c in covered.values())
    packed = plan_packing(lengths, 64)
    assert plan.fill_ratio() == pytest.approx(lengths.sum() / (64 * pieces))
    assert plan.fill_ratio() < 0.6 < 0.95 < packed.fill_ratio()  # what one per row costs
