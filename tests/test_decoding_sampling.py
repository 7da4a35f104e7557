"""Speculative sampling has exactly the target's distribution (conditions on the correction).

A tiny random target (V = 4) and a random circuit draft: the empirical distribution of the
first 3 generated tokens over many seeds matches the target's, enumerated exactly over all
V^3 continuations (chi-square, fixed seeds), for every family and both exact policies. A
constructed case shows the paper's ``drop`` policy is biased: target p = (1/2, 1/2), a draft
that always proposes A gives P(x_2 = A | x_1 = A) = 3/4 instead of 1/2.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mtpc
from mtpc.model import MTPCModel
from tests.fakes import (
    FAMILIES,
    SAMPLING_LENGTH,
    SAMPLING_PROMPT,
    SAMPLING_VOCAB,
    chi2_pvalue,
    exact_distribution,
    make_target,
    sampled_counts,
)

V, L, N = SAMPLING_VOCAB, SAMPLING_LENGTH, 1000
PROMPT = SAMPLING_PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    hf = make_target(vocab=V, hidden=16, seed=1, context=64)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)  # a peaked, position-dependent target
    return hf


@pytest.mark.parametrize(
    "policy,proposal",
    [
        ("condition", "path"),
        ("recompute", "path"),
        ("condition", "marginal"),
        ("recompute", "first_marginal"),
    ],
)
@pytest.mark.parametrize("kind,rank", FAMILIES)
@pytest.mark.slow
def test_sampling_matches_the_enumerated_target(
    target, kind: str, rank: int, policy: str, proposal: str
) -> None:  # type: ignore[no-untyped-def]
    """Every proposal: the latent path's q(. | z) (path), the marginal q(x_i | x_<i)
    (marginal), the marginal at the first draft then q(. | z) (first_marginal)."""
    torch.manual_seed(2)
    model = MTPCModel.from_hf(
        target, kind=kind, window=2, rank=rank, head_init="random", init_std=0.5
    )
    probs = exact_distribution(target, PROMPT, L)
    counts = sampled_counts(model, policy, N, proposal=proposal)
    assert chi2_pvalue(counts, probs) > 1e-3, (kind, policy, proposal)


@pytest.mark.slow
def test_sampling_with_temperature_top_k_and_lora_matches_the_processed_target() -> None:
    hf = make_target(vocab=V, hidden=16, seed=3, context=64)
    torch.manual_seed(4)
    model = MTPCModel.from_hf(
        hf, kind="btree", window=3, rank=2, lora_layers=1, head_init="random", init_std=0.5
    )
    with torch.no_grad():
        for p in model.backbone.lora.parameters():
            p.normal_(0, 0.1)
    T, top_k = 0.7, 3
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = hf(ids).logits.double() / T  # (V^L, P + L, V)
    kth = logits.topk(top_k, -1).values[..., -1:]
    logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    P = len(PROMPT)
    probs = sum(logp[:, P - 1 + i].gather(1, seqs[:, i : i + 1])[:, 0] for i in range(L)).exp()
    counts = sampled_counts(model, "condition", 600, temperature=T, top_k=top_k)
    assert chi2_pvalue(counts, probs) > 1e-3


@pytest.mark.slow
def test_drop_is_biased_and_condition_is_not() -> None:
    """Target p = (1/2, 1/2) everywhere, draft always A: drop gives P(A | A) = 3/4."""
    hf = make_target(vocab=2, hidden=16, seed=5, context=64)
    with torch.no_grad():
        hf.lm_head.weight.zero_()  # uniform target
    model = MTPCModel.from_hf(hf, kind="ff", window=2, rank=1, head_init="random")

    def always_a(e: torch.Tensor, positions=None, units=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        k = 2 if positions is None else len(positions)
        shape = (e.shape[0], k, 2) if units is not None else (e.shape[0], k, 1, 2)
        return torch.tensor([0.0, -30.0]).expand(shape)  # q(A) = 1 at every position

    model.head.input_logits = always_a  # type: ignore[method-assign]
    freq = {}
    for policy in ("drop", "condition", "recompute"):
        pairs = [
            mtpc.generate(
                model,
                [0, 1],
                2,
                greedy=False,
                seed=s,
                policy=policy,
                proposal="marginal",
                stop_ids=(),
            ).tokens
            for s in range(800)
        ]
        after_a = [b for a, b in pairs if a == 0]
        freq[policy] = sum(b == 0 for b in after_a) / len(after_a)
    assert freq["drop"] == pytest.approx(0.75, abs=0.06)
    assert freq["condition"] == pytest.approx(0.5, abs=0.06)
    assert freq["recompute"] == pytest.approx(0.5, abs=0.06)
