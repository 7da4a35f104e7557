"""Verification rules shared by every speculative decoder in MTPC.

Self-speculative decoding with circuit drafts (``mtpc.decoding.speculative``) and the
heterogeneous-vocabulary algorithms (``mtpc.decoding.hetero``) verify drafts with the same
two rules, implemented once here:

* greedy (exact match): accept the longest prefix of the draft that equals the target's
  argmax at each position, then emit the target's own argmax (the correction, or the
  bonus token when every draft was accepted);
* speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept draft x_i with
  probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of the
  residual norm(max(0, p_i - q_i)); if all are accepted emit a sample of p_{n+1}. The
  emitted tokens are distributed exactly as the target's, whatever q is, as long as
  x_i was drawn from q_i (the draft's conditional given the accepted prefix).

And the logit processing (temperature, top-k, top-p) that must be applied identically to
the target and the draft for the output to follow the processed target distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Verdict:
    """Result of verifying one drafted window.

    Attributes:
        accepted: s, the number of drafted tokens accepted (0..n).
        next_token: the token emitted after them: the correction sampled from the residual
            (or the target's argmax) when s < n, the bonus token from the target when s = n.
    """

    accepted: int
    next_token: int


def process_logits(
    logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; returns log-probs (..., V).

    Removed tokens get -inf. ``temperature`` must be > 0 (greedy decoding uses argmax
    and needs no processing).
    """
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
    """norm(max(0, p - q)) over the last dim; falls back to p where p <= q everywhere.

    The fallback is only reachable through rounding (a rejection has probability
    1 - sum min(p, q) = 0 when p <= q everywhere), so it never changes the distribution.
    """
    diff = (target_probs - draft_probs).clamp(min=0.0)
    mass = diff.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp(min=torch.finfo(diff.dtype).tiny), target_probs)


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator).item())


def verify_greedy(target_argmax: Tensor, draft: Tensor) -> Verdict:
    """Exact-match verification.

    Args:
        target_argmax: the target's argmax after the context and after each drafted
            prefix; (n + 1,) int.
        draft: drafted tokens; (n,) int.
    """
    n = draft.shape[0]
    if target_argmax.shape[0] != n + 1:
        raise ValueError(
            f"target_argmax must have n + 1 = {n + 1} entries, got {target_argmax.shape[0]}"
        )
    mismatch = (draft != target_argmax[:n]).nonzero()
    accepted = int(mismatch[0, 0]) if mismatch.numel() else n
    return Verdict(accepted, int(target_argmax[accepted]))


def verify_sampling(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft: Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative-sampling verification (rejection + residual + bonus).

    Args:
        target_probs: p(. | context, x_1..x_{i-1}) for i = 1..n+1; (n + 1, V).
        draft_probs: q(. | context, x_1..x_{i-1}) the drafts were drawn from; (n, V).
        draft: the drafted tokens; (n,).
        generator: RNG for the acceptance tests and the emitted sample.
    """
    n = draft.shape[0]
    if draft_probs.shape[0] != n:
        raise ValueError(
            f"need target_probs (n+1, V) and draft_probs (n, V) for n = {n}; got "
            f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}"
        )
    positions = torch.arange(n, device=draft.device)
    return verify_sampling_lazy(
        target_probs, draft_probs[positions, draft], draft, draft_probs.__getitem__, generator
    )


def verify_sampling_lazy(
    target_probs: Tensor,
    draft_token_probs: Tensor | Callable[[int], float],
    draft: Tensor,
    draft_dist: Callable[[int], Tensor],
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative-sampling verification with the draft's full conditional computed on demand.

    The same rule as :func:`verify_sampling`, for drafters whose full conditionals are costly
    but whose probability at the drafted token is cheap (a circuit: all ``q(x_i | x_<i)`` at
    the drafted tokens come from one prefix-marginal pass; the full ``q(. | x_<s)`` is needed
    only at the first rejection, for the residual).

    Args:
        target_probs: p(. | context, x_1..x_{i-1}) for i = 1..n+1; (n + 1, V).
        draft_token_probs: q(x_i | context, x_1..x_{i-1}) at the drafted tokens; (n,), or
            ``i -> q_i(x_i)`` computed on demand: asked only where the test needs it (u_i >=
            p_i(x_i); below that, x_i is accepted whatever q_i <= 1), up to the first rejection.
        draft: the drafted tokens; (n,).
        draft_dist: ``s -> q(. | context, x_1..x_s)`` (V,), called at most once, with the
            index s of the first rejected draft.
        generator: RNG for the acceptance tests and the emitted sample.
    """
    n = draft.shape[0]
    shape = tuple(draft_token_probs.shape) if isinstance(draft_token_probs, Tensor) else None
    if target_probs.shape[0] != n + 1 or shape not in (None, (n,)):
        got = "a callable" if shape is None else shape
        raise ValueError(
            f"need target_probs (n+1, V) and draft_token_probs (n,) for n = {n}; got "
            f"{tuple(target_probs.shape)} and {got}"
        )
    if n:
        positions = torch.arange(n, device=draft.device)
        p = target_probs[positions, draft].double()  # (n,)
        u = torch.rand(n, generator=generator, dtype=torch.float64, device=p.device)
        s = n
        if isinstance(draft_token_probs, Tensor):
            q = draft_token_probs.double()  # (n,)
            ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.ones_like(p))
            rejected = (u >= ratio).nonzero()
            s = int(rejected[0, 0]) if rejected.numel() else n
        else:  # u < p <= p / q: accepted without q; else ask q_i, in order
            for i in (u >= p).nonzero()[:, 0].tolist():
                q_i = float(draft_token_probs(i))
                if q_i > 0 and float(u[i]) >= float(p[i]) / q_i:
                    s = i
                    break
        if s < n:
            q_s = draft_dist(s).to(target_probs.dtype)  # (V,)
            return Verdict(s, _sample(residual(target_probs[s], q_s), generator))
    return Verdict(n, _sample(target_probs[n], generator))
