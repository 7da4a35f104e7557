"""cirkit (libcirkit 0.3.1) as an oracle for the engine, and structural properties."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtpc.circuits import CircuitParams, build_circuit
from mtpc.circuits.cirkit_bridge import check_structural_properties, to_cirkit

pytest.importorskip("cirkit")
from cirkit.backend.torch.queries import IntegrateQuery
from cirkit.pipeline import compile as cirkit_compile

CASES = [("ff", 1, 3), ("cp", 3, 3), ("hmm", 2, 4), ("btree", 2, 5), ("btree", 3, 1)]


@pytest.mark.parametrize(("kind", "rank", "window"), CASES)
def test_smooth_and_decomposable(kind: str, rank: int, window: int) -> None:
    props = check_structural_properties(build_circuit(kind, window, rank).structure)
    assert props == {"smooth": True, "decomposable": True}


@pytest.mark.parametrize(("kind", "rank", "window"), CASES)
def test_cirkit_oracle_agrees(kind: str, rank: int, window: int) -> None:
    vocab = 3
    c = build_circuit(kind, window, rank)
    U = c.num_sum_units
    params = CircuitParams.from_logits(
        torch.randn(1, window, rank, vocab, dtype=torch.float64),
        torch.randn(1, U, rank, dtype=torch.float64) if U else None,
    )
    weights = None if params.sum_logw is None else params.sum_logw[0].exp()
    sc = to_cirkit(c.structure, params.input_logp[0].exp(), weights)
    assert sc.is_smooth and sc.is_decomposable
    cc = cirkit_compile(sc)  # lse-sum semiring: log-likelihoods (fp32 parameters)
    X = torch.tensor(list(itertools.product(range(vocab), repeat=window)))
    N = X.shape[0]
    expanded = params[torch.zeros(N, dtype=torch.long)]
    ours = c.log_prob(expanded, X)
    theirs = cc(X).view(N).double()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # marginals: integrate a random subset of positions per row
    mask = torch.rand(N, window) < 0.5
    theirs_m = IntegrateQuery(cc)(X, integrate_vars=mask).view(N).double()
    ours_m = c.marginal_log_prob(expanded, X, ~mask)
    torch.testing.assert_close(ours_m, theirs_m, atol=1e-5, rtol=1e-5)
