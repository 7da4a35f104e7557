"""Token trees (``tree_budget``): the best prefixes, one-pass tree verification, exactness.

* ``build_tree`` returns exactly the B most probable draft prefixes under q(. | evidence),
  checked against every prefix enumerated on a tiny vocabulary;
* tree-mask logits of every node equal the logits of decoding its root path alone, on the
  Llama family and the byte Llama (whose embedding reads each node's own history), and a
  cache compacted to one path continues like a cache that only ever saw it;
* greedy tree decoding equals AR for 4 families x windows x k x budgets x policies;
* sampled tree decoding has the target's distribution (chi-square on V = 4);
* a tree beats the chain where it must: a target with two equally likely continuations;
* EvaByte (no tree attention) falls back to the chain, exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mtpc
from mtpc.circuits.tree import build_tree
from mtpc.decoding.tree import verify_layout
from mtpc.model import MTPCModel
from tests.fakes import (
    FAMILIES,
    PROMPTS,
    SAMPLING_PROMPT,
    chi2_pvalue,
    exact_distribution,
    fake_evabyte,
    fake_llama3_byte,
    make_model,
    make_target,
    sampled_counts,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind,rank", FAMILIES)
@pytest.mark.parametrize("evidence", [None, [3]])
def test_build_tree_is_the_budget_most_probable_prefixes(kind: str, rank: int, evidence) -> None:  # type: ignore[no-untyped-def]
    from mtpc.heads import MTPCHead

    V, n, budget = 5, 4, 9
    torch.manual_seed(0)
    head = MTPCHead(kind, n, rank, vocab_size=V, hidden_size=8, init_std=1.0)
    with torch.no_grad():
        params = head(torch.randn(1, 8))
    circuit = head.circuit
    ev = None if evidence is None else torch.tensor([evidence])
    m = 0 if ev is None else 1
    tree = build_tree(circuit, params, ev, budget)
    # every prefix of length 1..n - m, with its exact probability given the evidence
    probs = {}
    for length in range(1, n - m + 1):
        for rest in itertools.product(range(V), repeat=length):
            x = torch.tensor([[*(evidence or []), *rest] + [0] * (n - m - length)])
            seen = torch.zeros(1, n, dtype=torch.bool)
            seen[0, : m + length] = True
            logq = circuit.marginal_log_prob(params, x, seen)
            if m:
                logq = logq - circuit.marginal_log_prob(params, x, seen & (torch.arange(n) < m))
            probs[rest] = float(logq.exp())
    best = sorted(probs.values(), reverse=True)[:budget]
    got = sorted(tree.log_probs.exp().tolist(), reverse=True)
    assert got == pytest.approx(best, rel=1e-4)
    assert tree.expected_accepted == pytest.approx(sum(best), rel=1e-4)
    by_depth = tree.expected_by_depth(n - m)  # P_q(>= d accepted): the depth-d nodes' mass
    assert sum(by_depth) == pytest.approx(sum(best), rel=1e-4)
    depths = range(1, n - m + 1)
    assert by_depth == pytest.approx(
        [float(tree.log_probs[tree.depths == d].exp().sum()) for d in depths]
    )
    paths: list[tuple[int, ...]] = []
    for i, (p, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        assert p < i  # topological
        paths.append((*(paths[p] if p >= 0 else ()), tok))
        assert probs[paths[-1]] == pytest.approx(float(tree.log_probs[i].exp()), rel=1e-4)
        assert len(paths[-1]) == int(tree.depths[i])
    assert len(set(paths)) == budget
    floor = sorted(best)[budget // 2]
    assert min(build_tree(circuit, params, ev, budget, floor).log_probs.exp()) >= floor * 0.999


def _random_tree(root: int | None, tokens: list[int], parents: list[int]):  # type: ignore[no-untyped-def]
    from mtpc.circuits.tree import TokenTree

    t = torch.tensor(tokens)
    par = torch.tensor(parents)
    depth = torch.zeros(len(tokens), dtype=torch.long)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return TokenTree(t, par, depth, torch.zeros(len(tokens)))


@pytest.mark.parametrize("arch", ["llama", "llama3_byte"])
@pytest.mark.parametrize("k", [0, 1])
def test_tree_mask_logits_equal_each_path_alone_and_compaction(arch: str, k: int) -> None:
    hf = make_target(vocab=48) if arch == "llama" else fake_llama3_byte(2, vocab_size=40)
    model = MTPCModel.from_hf(hf, kind="cp", window=4, rank=2, lora_layers=k)
    if k:
        with torch.no_grad():
            for p in model.backbone.lora.parameters():
                p.normal_(0, 0.05)
    prompt = torch.tensor([[5, 7, 9, 3, 11]])
    tree = _random_tree(8, [1, 2, 3, 1, 4, 5, 6], [-1, -1, 0, 0, 1, 3, 3])
    ids, mask, depth = verify_layout(tree, 8)  # root 8, then 7 nodes
    caches = model.new_caches()
    model.draft_tail(model.verifier_tail(model.trunk(prompt, caches.trunk), caches.verifier))
    base = len(caches.trunk)
    h = model.trunk(ids[None], caches.trunk, base + depth, tree_mask=mask)
    rows = model.verifier_logits(
        model.verifier_tail(h, caches.verifier, base + depth, tree_mask=mask)
    )[0]
    for i in range(len(ids)):
        path = ids[mask[i]]  # the root path of node i, in order
        alone = model.verifier_logits(
            model.verifier_tail(model.trunk(torch.cat([prompt[0], path])[None]))
        )
        torch.testing.assert_close(rows[i], alone[0, -1], rtol=0, atol=1e-5)
    # keep the path root -> node 0 -> node 3 -> node 5 (pass offsets 0, 1, 4, 6), continue
    keep = torch.tensor([0, 1, 4, 6])
    caches.compact(base, keep)
    assert len(caches.trunk) == len(caches.verifier) == base + 4
    assert caches.trunk.ids[0].tolist() == [5, 7, 9, 3, 11, 8, 1, 1, 5]
    nxt = torch.tensor([[2]])
    h = model.trunk(nxt, caches.trunk)
    got = model.verifier_logits(model.verifier_tail(h, caches.verifier))[0, -1]
    full = torch.tensor([[5, 7, 9, 3, 11, 8, 1, 1, 5, 2]])
    ref = model.verifier_logits(model.verifier_tail(model.trunk(full)))[0, -1]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="compact keep"):
        caches.trunk.compact(base, torch.tensor([2, 1]))


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
@pytest.mark.parametrize("kind,rank", FAMILIES)
def test_greedy_tree_equals_autoregressive(kind: str, rank: int, window: int, k: int) -> None:
    model = make_model(kind, window, rank, k)
    for prompt in PROMPTS[:2]:
        ar = mtpc.generate(model, prompt, 16, method="autoregressive", stop_ids=()).tokens
        for budget, policy in ((2, "condition"), (16, "condition"), (5, "recompute"), (5, "drop")):
            sd = mtpc.generate(model, prompt, 16, stop_ids=(), tree_budget=budget, policy=policy)
            assert sd.tokens == ar, (kind, window, k, budget, policy)
            assert all(0 < nodes <= budget for nodes in sd.nodes[1:]) or window == 1


@pytest.mark.parametrize("kind,rank", FAMILIES)
@pytest.mark.slow
def test_sampled_tree_matches_the_enumerated_target(kind: str, rank: int) -> None:
    target = make_target(vocab=4, hidden=16, seed=1, context=64)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    torch.manual_seed(2)
    model = MTPCModel.from_hf(
        target, kind=kind, window=3, rank=rank, head_init="random", init_std=0.5
    )
    probs = exact_distribution(target, SAMPLING_PROMPT, 3)
    counts = sampled_counts(model, "condition", 400, tree_budget=3)
    assert chi2_pvalue(counts, probs) > 1e-3, kind


def test_a_tree_accepts_either_of_two_equally_likely_continuations() -> None:
    """Target p = (1/2, 1/2); the draft prefers A (q = 0.9): the chain accepts A only when it
    is the target's, min(1, 0.5 / 0.9) = 0.56 of its cycles; a budget-2 tree holds A and B and
    accepts whichever the target draws, every cycle."""
    hf = make_target(vocab=2, hidden=16, seed=5, context=128)
    with torch.no_grad():
        hf.lm_head.weight.zero_()
    model = MTPCModel.from_hf(hf, kind="ff", window=1, rank=1, head_init="random")
    prefer_a = torch.tensor([0.0, -2.1972])  # q(A) = 0.9

    def input_logits(e: torch.Tensor, positions=None, units=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        k = 1 if positions is None else len(positions)
        shape = (e.shape[0], k, 2) if units is not None else (e.shape[0], k, 1, 2)
        return prefer_a.expand(shape)  # every read of the head: the chain's and the tree's

    model.head.input_logits = input_logits  # type: ignore[method-assign]
    rates = {}
    for budget in (0, 2):
        accepted = []
        for seed in range(25):
            res = mtpc.generate(
                model, [0, 1], 20, greedy=False, seed=seed, policy="recompute", stop_ids=(),
                tree_budget=budget,
            )  # fmt: skip
            accepted += res.accepted[:-1]
        rates[budget] = sum(accepted) / len(accepted)
    assert rates[2] == 1.0
    assert rates[0] == pytest.approx(0.5 / 0.9, abs=0.08)


@pytest.mark.parametrize("kind", ["ff", "btree"])
def test_evabyte_trees_stop_at_the_eva_window_and_equal_ar(kind: str) -> None:
    """EvaByte verifies a tree in one multibyte pass; trees are cut at each EVA window's end."""
    model = MTPCModel.from_hf(
        fake_evabyte(2, window_size=8, chunk_size=4),
        kind=kind,
        window=4,
        rank=1 if kind == "ff" else 2,
    )
    prompt = [70, 71, 72]
    ar = mtpc.generate(model, prompt, 40, method="autoregressive", stop_ids=()).tokens
    sd = mtpc.generate(model, prompt, 40, stop_ids=(), tree_budget=6)
    assert sd.tokens == ar
    assert sd.nodes and max(sd.nodes) > 1  # real trees, not the chain


@pytest.mark.parametrize(
    "kwargs,message",
    [({"tree_budget": -1}, "tree_budget=-1"), ({"tree_floor": 1.5}, "tree_floor=1.5")],
)
def test_bad_tree_arguments_name_the_field(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    model = make_model("cp", 2, 2)
    with pytest.raises(ValueError, match=message):
        mtpc.generate(model, [1, 2], 4, **kwargs)


@pytest.mark.parametrize("policy", ["condition", "recompute", "drop"])
def test_rows_whose_tree_is_empty_keep_their_caches(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A floor that prunes every node leaves a row with no pass in a cycle (nothing pending
    after the prefill or a recompute): its caches stay as they were (no keep of another pass),
    so the output is still AR's, alone and with other rows, and such cycles did happen."""
    from mtpc.decoding import loop

    idle, verify_pass = [], loop.verify_pass

    def spy(run, layout, rows, proposals):  # type: ignore[no-untyped-def]
        idle.append(sum(not p.ids.numel() for p in proposals))
        return verify_pass(run, layout, rows, proposals)

    monkeypatch.setattr(loop, "verify_pass", spy)
    model = make_model("btree", 4, 3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 9], [8]]
    kw = {"policy": policy, "stop_ids": ()}
    for size in (1, 3):
        ar = mtpc.generate(model, prompts, 20, batch_size=size, method="autoregressive", **kw)
        tree = mtpc.generate(
            model, prompts, 20, batch_size=size, tree_budget=4, tree_floor=0.9999, **kw
        )
        assert [r.tokens for r in tree] == [r.tokens for r in ar]
    assert sum(idle) >= 3
