"""Training objectives for MTPC heads: the composite NLL (paper Eq. 4; its conditionals come
from the circuit's prefix marginals, so the joint is trained) and the forward KL (App. G,
Eq. 5), both from per-window-position terms. See docs/TRAINING.md, "Objective"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def default_gamma(window: int) -> float:
    """The paper's discount: 0.8, or 0.9 for windows longer than 8."""
    return 0.9 if window > 8 else 0.8


def discount_weights(window: int, gamma: float | None = None) -> Tensor:
    """gamma^{j-1} for j = 1..window; (n,). ``gamma`` in (0, 1] (``loss.gamma``, checked at the
    door); None: :func:`default_gamma`."""
    gamma = default_gamma(window) if gamma is None else gamma
    return gamma ** torch.arange(window, dtype=torch.float64)


def conditionals_from_prefix(prefix_log_probs: Tensor) -> Tensor:
    """log q(x_j | x_{<j}) from prefix marginals log q(x_{1..j}); same shape (..., n)."""
    previous = torch.nn.functional.pad(prefix_log_probs[..., :-1], (1, 0))
    return prefix_log_probs - previous


@dataclass
class LossOutput:
    """A loss and its per-window-position terms."""

    loss: Tensor  # the discounted total sum_j gamma^{j-1} L_j (scalar, differentiable)
    per_position: Tensor  # L_j for j = 1..n, detached; (n,)


def _normalised_sum(
    terms: Tensor, target_mask: Tensor, gamma: float | None, normalise_discount: bool = False
) -> LossOutput:
    """-(1/N) sum_i (1/V_{i,j}) sum_t terms, discounted over j; ``terms`` (N, L, n)
    log-likelihood-like (larger is better), valid where ``target_mask`` (N, L, n).
    ``normalise_discount`` divides by sum_j gamma^{j-1}: a weighted mean of the L_j (same
    optimum, a scale independent of n)."""
    mask = target_mask.to(terms.dtype)
    valid_counts = mask.sum(dim=1)  # (N, n): V_{i,j}
    summed = (terms * mask).sum(dim=1)  # (N, n)
    per_sequence = summed / valid_counts.clamp(min=1.0)  # sequences with V_ij = 0 add 0
    per_position = -per_sequence.mean(dim=0)  # (n,)
    weights = discount_weights(terms.shape[-1], gamma).to(per_position)
    if normalise_discount:
        weights = weights / weights.sum()
    return LossOutput((weights * per_position).sum(), per_position.detach())


def composite_nll(
    prefix_log_probs: Tensor,
    target_mask: Tensor,
    gamma: float | None = None,
    normalise_discount: bool = False,
) -> LossOutput:
    """The discounted composite NLL over overlapping windows (paper Eq. 4).
    ``prefix_log_probs``: log q(x_{t+1..t+j} | x_{<=t}) for every sequence i, position t and
    window position j; (N, L, n). ``target_mask``: True where x_{t+j} is a valid target (an
    assistant byte of the same document); (N, L, n). ``gamma``: None for the paper's default."""
    if prefix_log_probs.shape != target_mask.shape:
        raise ValueError(
            f"prefix_log_probs {tuple(prefix_log_probs.shape)} and target_mask "
            f"{tuple(target_mask.shape)} must have the same (N, L, n) shape"
        )
    conditionals = conditionals_from_prefix(prefix_log_probs)
    return _normalised_sum(conditionals, target_mask, gamma, normalise_discount)


def distillation_kl(
    teacher_log_probs: Tensor,
    draft_log_conditionals: Tensor,
    target_mask: Tensor,
    gamma: float | None = None,
    normalise_discount: bool = False,
) -> LossOutput:
    """Forward KL(p || q) per window position, normalised like Eq. 4 (paper App. G, Eq. 5).
    ``teacher_log_probs``: the target's log p(. | x_{<t+j}) for the byte at window position j
    of position t; (N, L, n, V). ``draft_log_conditionals``: the draft's
    log q(. | x_{t+1..t+j-1}, x_{<=t}); (N, L, n, V). ``target_mask``: (N, L, n)."""
    teacher = teacher_log_probs.float()
    kl = (teacher.exp() * (teacher - draft_log_conditionals.float())).sum(dim=-1)  # (N, L, n)
    return _normalised_sum(-kl, target_mask, gamma, normalise_discount)


def expected_accepted(prefix_log_probs: Tensor, target_mask: Tensor) -> Tensor:
    """Expected drafts accepted per window when the data plays the target (the validation
    proxy for mu_acc): a window drafted from q is accepted up to position j iff its first j
    bytes are the data's, probability q(x_{1..j}); so E[accepted] = sum_j q(x_{1..j}) over the
    leading run of valid targets, averaged over windows whose first target is valid; ()."""
    valid_run = torch.cumprod(target_mask.to(prefix_log_probs.dtype), dim=-1)  # (N, L, n)
    accepted = (prefix_log_probs.exp() * valid_run).sum(dim=-1)  # (N, L)
    starts = target_mask[..., 0]
    if not bool(starts.any()):
        return prefix_log_probs.new_zeros(())
    return accepted[starts].mean()
