"""EvaByte verifies a drafted window in one pass, exactly, across EVA windows.

The fake EvaByte (``tests/fakes.py``) computes EVA attention densely in its own full forward
(all singletons and all chunk RFAs under one mask); the backbone's cached path runs one
multibyte pass per call on the window cache, keeps positions by index and compresses each
full window into chunk RFAs. Windows are small here (W = 8, chunk 4) so that generations
cross several windows and compressions.
"""

from __future__ import annotations

import pytest
import torch

import mtpc
from mtpc.model import MTPCModel
from tests.fakes import chi2_pvalue, exact_distribution, fake_evabyte, oracle, randomize_lora

W, C, V = 8, 4, 320


def eva_model(k: int = 0, window: int = 4, layers: int = 3, **fake: int) -> MTPCModel:
    hf = fake_evabyte(layers, **{"window_size": W, "chunk_size": C, **fake})
    model = MTPCModel.from_hf(hf, kind="cp", window=window, rank=2, lora_layers=k)
    if k:
        randomize_lora(model)
    return model


def full(model: MTPCModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifier and draft hidden states of the full (cache-free) forward."""
    trunk = model.trunk(ids)
    return model.verifier_tail(trunk), model.draft_tail(trunk)


def cached(model: MTPCModel, caches, ids: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
    h = model.trunk(ids, caches.trunk, **kw)
    return model.verifier_tail(h, caches.verifier, **kw), model.draft_tail(h, caches.draft, **kw)


def count_layer_calls(model: MTPCModel) -> list[int]:
    calls = [0]
    for layer in model.backbone.layers:
        layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("k", [0, 1])
def test_cached_runs_equal_the_full_forward_across_windows(k: int) -> None:
    model = eva_model(k)
    ids = torch.randint(0, V, (1, 48))
    ref_v, ref_d = full(model, ids)
    caches = model.new_caches()
    pos = 0
    for step in (13, 3, 1, 4, 2, 11, 14):  # 11 and 14 cross window boundaries (cut into pieces)
        v, d = cached(model, caches, ids[:, pos : pos + step])
        torch.testing.assert_close(v, ref_v[:, pos : pos + step], rtol=0, atol=2e-5)
        torch.testing.assert_close(d, ref_d[:, pos : pos + step], rtol=0, atol=2e-5)
        pos += step
    assert [len(c) for c in caches] == [pos] * 3
    # every full window compressed; the last run's positions are kept (and compressed) when the
    # next run starts or a compact keeps them
    assert caches.trunk.native.chunks() == (pos - 1) // W * (W // C)
    caches.trunk.compact(pos, torch.zeros(0, dtype=torch.long))
    assert caches.trunk.native.chunks() == pos // W * (W // C)


def test_one_pass_verify_equals_sequential_and_calls_each_layer_once() -> None:
    model = eva_model(k=1)
    ids = torch.randint(0, V, (1, 24))
    caches = model.new_caches()
    cached(model, caches, ids[:, :17])
    w = model.backbone.one_pass_span(17, 16)
    assert w == W - 17 % W == 7  # trimmed at the window boundary
    seq_caches = caches.clone()
    calls = count_layer_calls(model)
    one = model.verifier_logits(cached(model, caches, ids[:, 17 : 17 + w])[0])
    assert calls[0] == model.backbone.num_layers + model.k  # trunk + verifier tail + draft tail
    steps = [cached(model, seq_caches, ids[:, i : i + 1])[0] for i in range(17, 17 + w)]
    torch.testing.assert_close(one, model.verifier_logits(torch.cat(steps, 1)), rtol=0, atol=1e-5)
    assert calls[0] == (1 + w) * (model.backbone.num_layers + model.k)


def test_tree_mask_verifies_branches_and_compact_keeps_a_path() -> None:
    model = eva_model(k=1)
    ids = torch.randint(0, V, (1, 14))
    other = torch.randint(0, V, (1, 1))
    ref_v, _ = full(model, ids)
    ref_b, _ = full(model, torch.cat([ids[:, :11], other], 1))
    caches = model.new_caches()
    cached(model, caches, ids[:, :10])
    # nodes: r = x10 (depth 0), a = x11, b = other (children of r), c = x12 (child of a)
    nodes = torch.cat([ids[:, 10:12], other, ids[:, 12:13]], 1)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    positions = 10 + torch.tensor([0, 1, 1, 2])
    v, _ = cached(model, caches, nodes, positions=positions, tree_mask=tree)
    torch.testing.assert_close(v[:, [0, 1, 3]], ref_v[:, 10:13], rtol=0, atol=2e-5)
    torch.testing.assert_close(v[:, 2], ref_b[:, 11], rtol=0, atol=2e-5)
    caches.compact(10, torch.tensor([0, 1, 3]))
    caches.draft.compact(10, torch.tensor([0, 1, 3]))
    assert [len(c) for c in caches] == [13] * 3
    assert torch.equal(caches.trunk.ids, ids[:, :13])
    v, _ = cached(model, caches, ids[:, 13:14])
    torch.testing.assert_close(v, ref_v[:, 13:14], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="past the EVA window"):  # 14 + depth 2 >= 16
        cached(model, caches, nodes[:, :3], positions=14 + torch.tensor([0, 1, 2]),
               tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())  # fmt: skip


def test_crop_by_index_inside_the_window_not_behind_a_compressed_one() -> None:
    model = eva_model()
    ids = torch.randint(0, V, (1, 22))
    ref_v, _ = full(model, ids)
    caches = model.new_caches()
    cached(model, caches, ids[:, :6])
    caches.crop(3)  # kept positions of the current window can be dropped
    v, _ = cached(model, caches, ids[:, 3:20])
    torch.testing.assert_close(v, ref_v[:, 3:20], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="compressed into EVA's chunk RFAs"):
        caches.trunk.crop(15)
    with pytest.raises(ValueError, match="crop length"):
        caches.trunk.crop(99)
    caches.crop(17)
    v, _ = cached(model, caches, ids[:, 17:18])
    torch.testing.assert_close(v, ref_v[:, 17:18], rtol=0, atol=2e-5)


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("k", [0, 1])
def test_greedy_speculative_equals_autoregressive_across_windows(n: int, k: int) -> None:
    model = eva_model(k, window=n)
    prompt, new = torch.randint(0, V, (5,)).tolist(), 40  # positions 5..44: 5 windows
    ar = mtpc.generate(model, prompt, new, method="autoregressive", stop_ids=()).tokens
    reference = prompt + ar
    runs = {
        "head": mtpc.generate(model, prompt, new, stop_ids=()),
        "oracle": mtpc.generate(model, prompt, new, stop_ids=(), drafter=oracle(reference, n, None)),
        "reject-at-2": mtpc.generate(model, prompt, new, stop_ids=(), drafter=oracle(reference, n, 2)),
        "recompute": mtpc.generate(model, prompt, new, stop_ids=(), policy="recompute",
                                   drafter=oracle(reference, n, None)),
    }  # fmt: skip
    for name, res in runs.items():
        assert res.tokens == ar, name
    accepted = runs["oracle"]
    assert max(accepted.drafted) <= min(n, W)
    if n >= W:  # every drafted window is trimmed to end at an EVA window boundary
        ends = 5 + torch.tensor(accepted.emitted[:-1]).cumsum(0)
        assert all(int(e) % W == 1 for e in ends[1:])  # + the pending token past the boundary


@pytest.mark.slow
def test_sampling_matches_the_enumerated_target_across_a_window_boundary() -> None:
    torch.manual_seed(3)
    hf = fake_evabyte(2, hidden_size=16, vocab_size=4, window_size=4, chunk_size=2)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    model = MTPCModel.from_hf(hf, kind="cp", window=3, rank=2, head_init="random", init_std=0.5)
    prompt, length, draws = [1, 2, 3], 3, 400  # new positions 3, 4, 5: window 1 starts at 4
    probs = exact_distribution(hf, prompt, length)
    counts = torch.zeros(4**length)
    for seed in range(draws):
        res = mtpc.generate(model, prompt, length, greedy=False, seed=seed, stop_ids=())
        counts[sum(t * 4 ** (length - 1 - i) for i, t in enumerate(res.tokens))] += 1
    assert chi2_pvalue(counts, probs) > 1e-3


def test_a_cycle_calls_each_layer_once() -> None:
    model = eva_model(k=1, window=4, window_size=16, chunk_size=8)
    calls = count_layer_calls(model)
    res = mtpc.generate(model, torch.randint(0, V, (5,)).tolist(), 32, max_throughput=True,
                        stop_ids=())  # fmt: skip
    assert res.accepted == res.drafted and sum(res.accepted) > 2 * len(res.accepted)
    per_pass = model.backbone.num_layers + model.k
    assert calls[0] <= per_pass * (len(res.accepted) + 1)  # + the prefill
