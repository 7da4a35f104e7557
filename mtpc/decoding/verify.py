"""The verification rules of every speculative decoder (exact match; speculative sampling,
exact for any q as long as x_i was drawn from q_i) and the logit processing, applied
identically to target and draft. See docs/DECODING.md, "The cycle".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtpc.circuits.engine import inverse_cdf


@dataclass(frozen=True)
class Verdict:
    """Result of verifying one drafted window."""

    accepted: int  # s, the drafts accepted (0..n)
    next_token: int  # the correction (s < n) or the bonus token (s = n)


@dataclass(frozen=True)
class Verdicts:
    """Results of verifying B drafted chains at once."""

    accepted: Tensor  # (B,) s per row (0..m_b)
    tokens: Tensor  # (B,) the correction (s < m_b) or the bonus token (s = m_b)


def process_logits(
    logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """Temperature, then top-k, then top-p filtering: log-probs (..., V), removed tokens -inf.
    ``temperature`` must be > 0 (greedy decoding uses argmax)."""
    if not temperature > 0:  # also refuses NaN
        raise ValueError(f"temperature must be > 0, got {temperature}; use greedy=True for argmax")
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if top_k < vocab:
            kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # drop a token when the mass before it already reaches top_p (keeps >= 1 token)
            drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def residual(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim; p where p <= q everywhere (reachable through
    rounding only: a rejection then has probability 0, so the distribution is unchanged)."""
    diff = (target_probs - draft_probs).clamp(min=0.0)
    mass = diff.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp(min=torch.finfo(diff.dtype).tiny), target_probs)


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator).item())


def verify_greedy(target_argmax: Tensor, draft: Tensor) -> Verdict:
    """Exact-match verification (:func:`accept_greedy` of one row): ``target_argmax``
    ``(n + 1,)`` after the context and after each drafted prefix; ``draft`` ``(n,)``."""
    n = draft.shape[0]
    if target_argmax.shape[0] != n + 1:
        raise ValueError(
            f"target_argmax must have n + 1 = {n + 1} entries, got {target_argmax.shape[0]}"
        )
    lengths = torch.tensor([n], device=target_argmax.device)
    verdicts = accept_greedy(target_argmax[None], draft[None], lengths)
    return Verdict(int(verdicts.accepted[0]), int(verdicts.tokens[0]))


def verify_sampling(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft: Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative-sampling verification (:func:`accept_sampling` of one row, then the
    residual or the bonus drawn from ``generator``): ``target_probs`` ``(n + 1, V)``
    p(. | context, x_<i) for i = 1..n+1, ``draft_probs`` ``(n, V)`` the q the drafts ``(n,)``
    were drawn from."""
    n = draft.shape[0]
    if target_probs.shape[0] != n + 1 or draft_probs.shape[0] != n:
        raise ValueError(
            f"need target_probs (n+1, V) and draft_probs (n, V) for n = {n}; got "
            f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}"
        )
    positions = torch.arange(n, device=draft.device)
    p, q = target_probs[positions, draft], draft_probs[positions, draft]  # (n,) each
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=p.device)
    s = int(accept_sampling(p[None], q[None], u[None], torch.tensor([n], device=p.device))[0])
    if s < n:
        q_s = draft_probs[s].to(target_probs.dtype)  # (V,)
        return Verdict(s, _sample(residual(target_probs[s], q_s), generator))
    return Verdict(n, _sample(target_probs[n], generator))


def first_rejection(accepted: Tensor, lengths: Tensor) -> Tensor:
    """s per row ``(B,)``: the accepted drafts before the first rejection, from ``accepted``
    ``(B, M)`` bool (padding past each row's ``lengths`` ``(B,)`` counts as a rejection)."""
    valid = torch.arange(accepted.shape[1], device=accepted.device) < lengths[:, None]
    return (accepted & valid).long().cumprod(1).sum(1)


def accept_greedy(choices: Tensor, drafts: Tensor, lengths: Tensor) -> Verdicts:
    """:func:`verify_greedy` of B rows: ``choices`` ``(B, M + 1)`` the target's argmax after
    the context and after each draft, ``drafts`` ``(B, M)``, row b's first ``lengths[b]``
    real (the rest padding)."""
    s = first_rejection(drafts == choices[:, :-1], lengths)  # (B,)
    return Verdicts(s, choices.gather(1, s[:, None])[:, 0])


def accept_sampling(p: Tensor, q: Tensor, u: Tensor, lengths: Tensor) -> Tensor:
    """The acceptance tests of :func:`verify_sampling` for B rows: s per row ``(B,)``.

    ``p``, ``q`` ``(B, M)``: p_i(x_i) and q_i(x_i) at the drafts (row b's first ``lengths[b]``
    real); ``u`` ``(B, M)`` float64: draft i is accepted when u_i < p_i(x_i) / q_i(x_i)
    (always when q_i(x_i) = 0).
    """
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.ones_like(p))
    return first_rejection(u < ratio, lengths)


def correction_or_bonus(
    target_probs: Tensor, accepted: Tensor, lengths: Tensor, proposals: Tensor, u: Tensor
) -> Tensor:
    """The token after s accepted drafts ``(B,)``: from the residual norm(max(0, p_s - q_s))
    where s < m_b, else the bonus from p_m, by inverse CDF with ``u`` ``(B,)``.

    ``target_probs`` ``(B, M + 1, V)``; ``proposals`` ``(B, V)``: q_s(.) where s < m_b (any
    other row's is ignored)."""
    index = accepted[:, None, None].expand(-1, 1, target_probs.shape[2])
    p_s = target_probs.gather(1, index)[:, 0]  # (B, V)
    rejected = (accepted < lengths)[:, None]
    dist = torch.where(rejected, residual(p_s, proposals.to(p_s.dtype)), p_s)
    return inverse_cdf(dist, u)
