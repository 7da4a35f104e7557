"""MTPC head: public API, initialisation, gradients, memory-lean likelihood, bad input."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import mtpc
from mtpc.heads import MTPCHead, chunked_log_likelihood

V, D = 4, 6
FAMILIES = [("ff", 1), ("cp", 3), ("hmm", 3), ("btree", 3)]


def make_head(kind: str, rank: int, window: int = 3, **kw: object) -> MTPCHead:
    return MTPCHead(kind, window, rank, V, D, **kw).double()  # type: ignore[arg-type]


def test_public_api_smoke() -> None:
    head = mtpc.MTPCHead(kind="btree", window=5, rank=2, vocab_size=V, hidden_size=D)
    assert (head.kind, head.window, head.rank, head.vocab_size) == ("btree", 5, 2, V)
    e = torch.randn(3, D)
    params = head(e)
    assert params.input_logp.shape == (3, 5, 2, V)
    x = torch.randint(V, (3, 5))
    assert head.circuit.log_prob(params, x).shape == (3,)
    pre = head.circuit.prefix_log_prob(params, x)
    assert pre.shape == (3, 5)
    torch.testing.assert_close(pre[:, -1], head.circuit.log_prob(params, x))
    g = torch.Generator().manual_seed(0)
    assert head.circuit.sample(params, generator=g).shape == (3, 5)
    s = head.circuit.sample(params, generator=g, evidence=x[:, :2])
    assert torch.equal(s[:, :2], x[:, :2])
    assert head.circuit.conditional_log_prob(params, x[:, :2]).shape == (3, V)
    assert head.circuit.map_decode(params, evidence=x[:, :1]).shape == (3, 5)
    assert head.circuit.greedy_chain(params).shape == (3, 5)
    sel = head.input_logits(e, positions=[0, 3])
    torch.testing.assert_close(sel, head.input_logits(e)[:, [0, 3]])
    pairs = head.input_logits(e, positions=[0, 3, 3], units=torch.tensor([1, 0, 1]))
    assert pairs.shape == (3, 3, V)  # (B, k, V): one row of W per (position, unit) pair
    torch.testing.assert_close(pairs, head.input_logits(e)[:, [0, 3, 3], [1, 0, 1]])


def _weights_read(head: MTPCHead, query: Any) -> tuple[torch.Tensor, int]:
    """``query(head)`` and the number of weights its ``F.linear`` calls multiplied."""
    import mtpc.heads

    read: list[int] = []
    linear = mtpc.heads.F.linear

    def counting(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        read.append(w.numel())
        return linear(x, w, *args)  # type: ignore[arg-type]

    mtpc.heads.F.linear = counting  # type: ignore[assignment]
    try:
        out = query(head)
    finally:
        mtpc.heads.F.linear = linear  # type: ignore[assignment]
    return out, sum(read)


@pytest.mark.parametrize(("kind", "rank"), [("cp", 4), ("ff", 1)])
def test_partial_input_logits_read_only_the_asked_rows_of_w(kind: str, rank: int) -> None:
    """(position, unit) pairs multiply len(pairs) x V x d weights, not the n x r x V x d table
    (a version that computes the table and then gathers fails the count)."""
    head = MTPCHead(kind, 4, rank, V, D)
    e = torch.randn(2, D)
    units = [1, 0, rank - 1] if rank > 1 else [0, 0, 0]
    got, read = _weights_read(head, lambda h: h.input_logits(e, positions=[0, 3, 2], units=units))
    assert read == 3 * V * D
    torch.testing.assert_close(got, head.input_logits(e)[:, [0, 3, 2], units])


def test_token_logits_read_r_vectors_per_pair() -> None:
    """Every unit's logit at (position, token) pairs equals the table's entry and multiplies
    k x r x d weights, not the k x r x V x d rows; bad shapes are refused."""
    head = MTPCHead("btree", 4, 3, V, D)
    e = torch.randn(2, D)
    positions, tokens = torch.tensor([0, 2]), torch.tensor([V - 1, 1])
    got, read = _weights_read(head, lambda h: h.token_logits(e, positions, tokens))
    assert got.shape == (2, 2, 3) and read == 2 * 3 * D
    table = head.input_logits(e)  # (B, n, r, V)
    torch.testing.assert_close(got, table[:, [0, 2], :, [V - 1, 1]].transpose(0, 1))
    with pytest.raises(ValueError, match="same length"):
        head.token_logits(e, positions, torch.tensor([1]))


@pytest.mark.parametrize(("kind", "rank"), FAMILIES)
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("extra", ["random", "repeat_last"])
def test_init_from_unembeddings_equals_ff(kind: str, rank: int, m: int, extra: str) -> None:
    n = 3
    U = torch.randn(m, V, D, dtype=torch.float64)
    ff, head = (
        make_head("ff", 1, n, extra_positions=extra),
        make_head(kind, rank, n, extra_positions=extra),
    )
    torch.manual_seed(0)  # the same random extra positions for both heads
    ff.from_pretrained_unembeddings(U)
    torch.manual_seed(0)
    head.from_pretrained_unembeddings(U)
    for i, j in itertools.product(range(n), range(rank)):
        torch.testing.assert_close(head.unembedding[i, j], ff.unembedding[i, 0])
        if i < m or extra == "repeat_last":
            torch.testing.assert_close(head.unembedding[i, j], U[min(i, m - 1)])
        else:  # past the pretrained heads: random, shared by the units
            assert not torch.equal(head.unembedding[i, j], U[m - 1])
            assert head.unembedding[i, j].std().item() == pytest.approx(head.init_std, rel=0.2)
    e = torch.randn(2, D, dtype=torch.float64)
    X = torch.tensor(list(itertools.product(range(V), repeat=n)))
    N = X.shape[0]
    idx = torch.arange(2).repeat_interleave(N)
    want = ff.circuit.log_prob(ff(e)[idx], X.repeat(2, 1))
    got = head.circuit.log_prob(head(e)[idx], X.repeat(2, 1))
    torch.testing.assert_close(got, want)
    # noise breaks the symmetry between units
    noisy = make_head(kind, rank, n).from_pretrained_unembeddings(U, noise_std=0.1)
    if rank > 1:
        assert not torch.equal(noisy.unembedding[0, 0], noisy.unembedding[0, 1])


def test_init_single_stp_head_and_bad_shape() -> None:
    U = torch.randn(V, D, dtype=torch.float64)
    head = make_head("cp", 2, extra_positions="repeat_last").from_pretrained_unembeddings(U)
    assert torch.equal(head.unembedding[2, 1], U)
    head = make_head("cp", 2).from_pretrained_unembeddings(U)  # default: random past head 1
    assert torch.equal(head.unembedding[0, 1], U)
    assert torch.equal(head.unembedding[2, 1], head.unembedding[2, 0])
    assert not torch.equal(head.unembedding[2, 1], U)
    with pytest.raises(ValueError, match="unembeddings must have shape"):
        head.from_pretrained_unembeddings(torch.randn(2, V + 1, D))
    with pytest.raises(ValueError, match="extra_positions must be one of"):
        make_head("cp", 2, extra_positions="zeros")


def test_hmm_transitions_identity_and_variants() -> None:
    e = torch.randn(2, D, dtype=torch.float64)
    head = make_head("hmm", 3, 4, sum_init_std=0.0)
    lw = head(e).sum_logw
    assert lw is not None
    trans = lw[:, :-1].exp().view(2, 3, 3, 3)  # (B, steps, z_i, z_{i+1})
    assert (trans.diagonal(dim1=-2, dim2=-1) > 0.99).all()
    torch.testing.assert_close(lw[:, -1].exp(), torch.full((2, 3), 1 / 3, dtype=torch.float64))

    homo = make_head("hmm", 3, 4, homogeneous=True)
    with torch.no_grad():
        homo.sum_proj.normal_()
    lw = homo(e).sum_logw
    assert lw is not None
    torch.testing.assert_close(lw[:, 0:3], lw[:, 3:6])
    assert homo.sum_bias.shape == (3 + 1, 3)

    nonctx = make_head("hmm", 3, 4, contextual_transitions=False)
    with torch.no_grad():
        nonctx.sum_proj.normal_()
        nonctx.sum_bias.normal_()
    lw = nonctx(e).sum_logw
    assert lw is not None
    torch.testing.assert_close(lw[0, :-1], lw[1, :-1])  # transitions ignore e
    assert not torch.allclose(lw[0, -1], lw[1, -1])  # the initial distribution does not

    uni = make_head("hmm", 3, 4, identity_init=False, sum_init_std=0.0)
    lw = uni(e).sum_logw
    assert lw is not None
    torch.testing.assert_close(lw.exp(), torch.full_like(lw, 1 / 3))


@pytest.mark.parametrize(("kind", "rank"), FAMILIES)
def test_gradients_flow_to_unembeddings_and_sum_projections(kind: str, rank: int) -> None:
    head = make_head(kind, rank, 4)
    e = torch.randn(5, D, dtype=torch.float64)
    x = torch.randint(V, (5, 4))
    loss = -head.circuit.prefix_log_prob(head(e), x).sum()
    loss.backward()
    assert head.unembedding.grad is not None and head.unembedding.grad.abs().sum() > 0
    if kind != "ff":
        assert head.sum_proj.grad is not None and head.sum_proj.grad.abs().sum() > 0
        assert head.sum_bias.grad is not None and head.sum_bias.grad.abs().sum() > 0


@pytest.mark.parametrize(("kind", "rank"), FAMILIES)
def test_chunked_likelihood_equals_unchunked(kind: str, rank: int) -> None:
    torch.manual_seed(1)
    head = make_head(kind, rank, 4)
    with torch.no_grad():
        head.sum_proj.normal_(0, 0.5)
    T = 23
    hidden = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(V, (T, 4))
    mask = torch.rand(T, 4) > 0.2
    targets = torch.where(mask, targets, -100)

    def run(chunk: int, ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        head.zero_grad()
        hidden.grad = None
        out = chunked_log_likelihood(head, hidden, targets, mask, chunk_size=chunk, checkpoint=ckpt)
        (out * torch.linspace(0.1, 1.0, 4, dtype=torch.float64)).sum().backward()
        tensors = (hidden, head.unembedding, head.sum_proj, head.sum_bias)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in tensors]
        return out.detach(), grads

    ref, ref_grads = run(T, False)
    # same as the engine on full parameters
    torch.testing.assert_close(
        ref, head.circuit.prefix_log_prob(head(hidden), targets, mask).detach()
    )
    for chunk in (1, 5, 8):
        out, grads = run(chunk, True)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, rg, atol=1e-6, rtol=1e-6)
    assert head.chunked_log_likelihood(hidden, targets, mask, chunk_size=4).shape == (T, 4)


def test_bad_head_arguments() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        MTPCHead("mlp", 4, 2, V, D)
    with pytest.raises(ValueError, match="window must be"):
        MTPCHead("cp", 0, 2, V, D)
    with pytest.raises(ValueError, match="rank must be"):
        MTPCHead("cp", 4, -1, V, D)
    with pytest.raises(ValueError, match="rank must be 1 for kind='ff'"):
        MTPCHead("ff", 4, 2, V, D)
    with pytest.raises(ValueError, match="vocab_size must be"):
        MTPCHead("cp", 4, 2, 0, D)
    with pytest.raises(ValueError, match="hidden_size must be"):
        MTPCHead("cp", 4, 2, V, 0)
    with pytest.raises(ValueError, match="options of kind='hmm' only"):
        MTPCHead("btree", 4, 2, V, D, homogeneous=True)
    head = MTPCHead("cp", 4, 2, V, D)
    with pytest.raises(ValueError, match=r"e must have shape \(B, hidden_size=6\)"):
        head(torch.randn(3, D + 1))
    with pytest.raises(ValueError, match="units needs positions of the same length"):
        head.input_logits(torch.randn(1, D), units=[0])
    with pytest.raises(ValueError, match="units needs positions of the same length"):
        head.input_logits(torch.randn(1, D), positions=[0, 1], units=[0])
    h, t = torch.randn(5, D), torch.randint(V, (5, 4))
    with pytest.raises(ValueError, match="targets must have shape"):
        chunked_log_likelihood(head, h, t[:, :3])
    with pytest.raises(ValueError, match="hidden must have shape"):
        chunked_log_likelihood(head, h[:, :2], t)
    with pytest.raises(ValueError, match="targets hold token ids outside"):
        chunked_log_likelihood(head, h, t + V)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        chunked_log_likelihood(head, h, t, torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk_size must be"):
        chunked_log_likelihood(head, h, t, chunk_size=0)
