"""The shared verification rules: exact match, and rejection sampling that preserves p."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from mtpc.decoding.speculative import Draft, drafted_probs
from mtpc.decoding.verify import (
    accept_sampling,
    process_logits,
    residual,
    verify_greedy,
    verify_sampling,
)


def test_greedy_accepts_the_matching_prefix_and_emits_the_target_token() -> None:
    target = torch.tensor([3, 1, 4, 1])
    verdict = verify_greedy(target, torch.tensor([3, 1, 4]))
    assert (verdict.accepted, verdict.next_token) == (3, 1)  # all accepted + bonus
    verdict = verify_greedy(target, torch.tensor([3, 2, 4]))
    assert (verdict.accepted, verdict.next_token) == (1, 1)  # correction at position 2
    verdict = verify_greedy(target, torch.tensor([0, 1, 4]))
    assert (verdict.accepted, verdict.next_token) == (0, 3)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.slow
def test_sampling_reproduces_the_target_distribution(n: int) -> None:
    """Emitted first tokens follow p whatever q is (chi-square over many draws)."""
    V = 4
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(n + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    counts = torch.zeros(V)
    draws = 8000
    for _ in range(draws):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(n)])
        verdict = verify_sampling(p, q, draft, generator=g)
        first = int(draft[0]) if verdict.accepted >= 1 else verdict.next_token
        counts[first] += 1
    assert chisquare(counts.numpy(), (p[0] * draws).numpy()).pvalue > 1e-3


def test_on_demand_q_gives_the_same_verdicts_and_is_asked_only_where_needed() -> None:
    """q_i as a callable (``speculative.drafted_probs``): the same acceptances as the eager
    vector, asked only where u_i >= p_i (below that x_i is accepted whatever q_i <= 1), never
    past the first rejection."""
    V, n = 5, 6
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([n])
    asked_total = 0
    for trial in range(300):
        p = torch.softmax(2 * torch.randn(n + 1, V, generator=g, dtype=torch.float64), -1)
        q = torch.softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
        draft = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(n)])
        p_tok, q_tok = p[torch.arange(n), draft][None], q[torch.arange(n), draft]  # (1, n), (n,)
        asked: list[int] = []

        def q_at(i: int, q_tok: torch.Tensor = q_tok, asked: list[int] = asked) -> float:
            asked.append(i)
            return float(q_tok[i])

        u = torch.rand(1, n, generator=torch.Generator().manual_seed(trial), dtype=torch.float64)
        eager = accept_sampling(p_tok, q_tok[None], u, lengths)
        lazy_q = drafted_probs([Draft(draft[None], q_at, q.__getitem__)], [n], p_tok, u)
        assert torch.equal(accept_sampling(p_tok, lazy_q, u, lengths), eager)
        s = int(eager[0])
        assert asked == [i for i in range(n) if u[0, i] >= p_tok[0, i] and i <= s]
        asked_total += len(asked)
    assert 0 < asked_total < 300 * n  # some tests needed q, many did not


def test_residual_is_a_distribution_and_zero_where_q_covers_p() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.6, 0.1, 0.3])
    r = residual(p, q)
    assert r.sum().item() == pytest.approx(1.0)
    assert r[0] == 0 and r[2] == 0 and r[1] == pytest.approx(1.0)
    assert torch.equal(residual(p, p), p)


def test_process_logits_filters_identically_and_validates() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    top2 = process_logits(logits, top_k=2).exp()
    assert top2[2:].sum() == 0 and top2.sum().item() == pytest.approx(1.0)
    nucleus = process_logits(logits, top_p=0.5).exp()
    assert nucleus[0].item() == pytest.approx(1.0)
    for kwargs in ({"temperature": 0.0}, {"top_k": 0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            process_logits(logits, **kwargs)  # type: ignore[arg-type]
