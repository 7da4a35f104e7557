"""The discounted composite NLL (paper Eq. 4) against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from mtpc.training.loss import (
    composite_nll,
    conditionals_from_prefix,
    default_gamma,
    discount_weights,
    distillation_kl,
    expected_accepted,
)


def test_default_gamma_follows_the_paper() -> None:
    assert default_gamma(8) == 0.8
    assert default_gamma(16) == 0.9
    assert discount_weights(3, 0.5).tolist() == [1.0, 0.5, 0.25]


def test_composite_nll_matches_hand_computed_normalisation() -> None:
    # N = 2 sequences, L = 3 positions, n = 2 window positions.
    conditionals = torch.tensor(
        [
            [[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]],
            [[-0.5, -1.5], [-2.5, -3.5], [-4.5, -5.5]],
        ],
        dtype=torch.float64,
    )
    prefix = conditionals.cumsum(dim=-1)
    mask = torch.tensor(
        [
            [[1, 1], [1, 0], [0, 0]],  # V_{1,1} = 2, V_{1,2} = 1
            [[1, 1], [1, 1], [1, 0]],  # V_{2,1} = 3, V_{2,2} = 2
        ],
        dtype=torch.bool,
    )
    gamma = 0.5
    out = composite_nll(prefix, mask, gamma=gamma)
    l1 = -((-1.0 - 3.0) / 2 + (-0.5 - 2.5 - 4.5) / 3) / 2
    l2 = -((-2.0) / 1 + (-1.5 - 3.5) / 2) / 2
    assert out.per_position.tolist() == pytest.approx([l1, l2])
    assert out.loss.item() == pytest.approx(l1 + gamma * l2)
    normalised = composite_nll(prefix, mask, gamma=gamma, normalise_discount=True)
    assert normalised.loss.item() == pytest.approx((l1 + gamma * l2) / (1 + gamma))
    assert normalised.per_position.tolist() == pytest.approx([l1, l2])


def test_normalised_kl_is_a_weighted_mean_of_positions() -> None:
    teacher = torch.log_softmax(torch.randn(1, 2, 3, 5, dtype=torch.float64), -1)
    draft = torch.log_softmax(torch.randn(1, 2, 3, 5, dtype=torch.float64), -1)
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    plain = distillation_kl(teacher, draft, mask, gamma=0.5)
    normalised = distillation_kl(teacher, draft, mask, gamma=0.5, normalise_discount=True)
    assert normalised.loss.item() == pytest.approx(plain.loss.item() / 1.75)


def test_sequence_without_valid_targets_adds_nothing() -> None:
    prefix = -torch.rand(2, 4, 3, dtype=torch.float64).cumsum(-1)
    mask = torch.ones(2, 4, 3, dtype=torch.bool)
    mask[1] = False
    full = composite_nll(prefix, mask, gamma=0.8)
    only_first = composite_nll(prefix[:1], mask[:1], gamma=0.8)
    assert full.loss.item() == pytest.approx(only_first.loss.item() / 2)


def test_conditionals_are_differences_of_prefix_marginals() -> None:
    prefix = torch.tensor([[-1.0, -3.0, -6.0]])
    assert conditionals_from_prefix(prefix).tolist() == [[-1.0, -2.0, -3.0]]


def test_gradients_reach_the_prefix_log_probs() -> None:
    prefix = (-torch.rand(2, 5, 4, dtype=torch.float64)).cumsum(-1).requires_grad_()
    composite_nll(prefix, torch.ones(2, 5, 4, dtype=torch.bool)).loss.backward()
    assert prefix.grad is not None and prefix.grad.abs().sum() > 0


def test_kl_is_zero_when_draft_equals_teacher_and_positive_otherwise() -> None:
    teacher = torch.log_softmax(torch.randn(2, 3, 2, 5, dtype=torch.float64), dim=-1)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    assert distillation_kl(teacher, teacher, mask).loss.item() == pytest.approx(0.0, abs=1e-12)
    other = torch.log_softmax(torch.randn(2, 3, 2, 5, dtype=torch.float64), dim=-1)
    assert distillation_kl(teacher, other, mask).loss.item() > 0


def test_expected_accepted_sums_prefix_probabilities_over_the_valid_run() -> None:
    prefix = torch.log(torch.tensor([[[0.5, 0.25, 0.125]]], dtype=torch.float64))
    mask = torch.tensor([[[True, True, False]]])
    assert expected_accepted(prefix, mask).item() == pytest.approx(0.75)
    assert expected_accepted(prefix, torch.ones_like(mask)).item() == pytest.approx(0.875)


def test_shape_mismatch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="same"):
        composite_nll(torch.zeros(1, 2, 3), torch.ones(1, 2, 4, dtype=torch.bool))
    assert math.isfinite(discount_weights(1)[0].item())
