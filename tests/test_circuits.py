"""Circuit engine math by brute-force enumeration over tiny vocabularies (float64)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from mtpc.circuits import Circuit, CircuitParams, build_circuit, build_structure

# (kind, rank, window, vocab)
CASES = [
    ("ff", 1, 1, 4),
    ("ff", 1, 4, 3),
    ("cp", 1, 3, 3),
    ("cp", 3, 4, 3),
    ("hmm", 2, 1, 5),
    ("hmm", 3, 4, 3),
    ("hmm", 2, 5, 3),
    ("btree", 2, 1, 4),
    ("btree", 2, 4, 3),
    ("btree", 3, 3, 5),
    ("btree", 2, 5, 3),
]
IDS = [f"{k}-r{r}-n{n}-V{v}" for k, r, n, v in CASES]


def random_params(
    circuit: Circuit, vocab: int, batch: int = 2, scale: float = 1.5
) -> CircuitParams:
    n, r, U = circuit.window, circuit.rank, circuit.num_sum_units
    logits = torch.randn(batch, n, r, vocab, dtype=torch.float64) * scale
    sums = torch.randn(batch, U, r, dtype=torch.float64) * scale if U else None
    return CircuitParams.from_logits(logits, sums)


def all_windows(n: int, vocab: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(vocab), repeat=n)), dtype=torch.long)


def repeat_rows(params: CircuitParams, reps: int) -> CircuitParams:
    """Row b of the result is row b // reps of ``params``."""
    idx = torch.arange(params.batch_size).repeat_interleave(reps)
    return params[idx]


def joint_table(circuit: Circuit, params: CircuitParams, vocab: int) -> torch.Tensor:
    """Probabilities of every window, ``(B, V^n)`` in itertools.product order."""
    X = all_windows(circuit.window, vocab)
    N, B = X.shape[0], params.batch_size
    lq = circuit.log_prob(repeat_rows(params, N), X.repeat(B, 1))
    return lq.view(B, N).exp()


def prefix_table(P: torch.Tensor, n: int, vocab: int, k: int) -> torch.Tensor:
    """Brute-force marginal of the first k positions, ``(B, V^k)``."""
    return P.view(P.shape[0], vocab**k, vocab ** (n - k)).sum(-1)


def code(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Base-V integer of each row of ``x`` (first position most significant)."""
    w = vocab ** torch.arange(x.shape[-1] - 1, -1, -1)
    return (x * w).sum(-1)


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES, ids=IDS)
def test_normalised_and_prefix_marginals(kind: str, rank: int, window: int, vocab: int) -> None:
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab)
    P = joint_table(c, params, vocab)  # (B, N)
    torch.testing.assert_close(P.sum(-1), torch.ones(2, dtype=torch.float64))
    X = all_windows(window, vocab)
    N = X.shape[0]
    pre = c.prefix_log_prob(repeat_rows(params, N), X.repeat(2, 1)).view(2, N, window)
    for k in range(1, window + 1):
        bf = prefix_table(P, window, vocab, k)  # (B, V^k)
        want = bf.gather(1, code(X[:, :k], vocab).expand(2, N)).log()
        torch.testing.assert_close(pre[:, :, k - 1], want)
    torch.testing.assert_close(pre[:, :, -1], P.log())


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES, ids=IDS)
def test_conditionals_are_ratios_of_marginals(
    kind: str, rank: int, window: int, vocab: int
) -> None:
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab)
    P = joint_table(c, params, vocab)
    x = torch.randint(vocab, (2, window))
    for m in range(window):
        got = c.conditional_log_prob(params, x[:, :m] if m else None)  # (B, V)
        joint = prefix_table(P, window, vocab, m + 1).view(2, vocab**m, vocab)
        row = code(x[:, :m], vocab) if m else torch.zeros(2, dtype=torch.long)
        want = joint[torch.arange(2), row]  # (B, V)
        torch.testing.assert_close(got, (want / want.sum(-1, keepdim=True)).log())


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES[::2], ids=IDS[::2])
def test_marginal_log_prob(kind: str, rank: int, window: int, vocab: int) -> None:
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab)
    P = joint_table(c, params, vocab).view(2, *([vocab] * window))
    x = torch.randint(vocab, (2, window))
    observed = torch.rand(2, window) < 0.5
    got = c.marginal_log_prob(params, x, observed)
    for b in range(2):
        t = P[b]
        for i in reversed(range(window)):
            t = t.select(i, int(x[b, i])) if observed[b, i] else t.sum(i)
        torch.testing.assert_close(got[b], t.log())


SAMPLE_CASES = [("ff", 1, 3, 3), ("cp", 3, 3, 3), ("hmm", 3, 3, 3), ("btree", 2, 3, 3)]
SAMPLE_CASES += [("btree", 3, 4, 2), ("hmm", 2, 4, 2)]


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("evidence_len", [0, 1, 2])
@pytest.mark.parametrize(
    ("kind", "rank", "window", "vocab"), SAMPLE_CASES, ids=[f"{c[0]}-n{c[2]}" for c in SAMPLE_CASES]
)
def test_sample_frequencies(
    kind: str, rank: int, window: int, vocab: int, evidence_len: int
) -> None:
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab, batch=1, scale=1.0)
    P = joint_table(c, params, vocab)[0]  # (N,)
    draws = 20000
    m = evidence_len
    ev = torch.randint(vocab, (1, m)) if m else None
    g = torch.Generator().manual_seed(1234)
    x = c.sample(
        repeat_rows(params, draws),
        generator=g,
        evidence=None if ev is None else ev.expand(draws, m),
    )
    assert x.shape == (draws, window) and x.dtype == torch.long
    if ev is not None:
        assert torch.equal(x[:, :m], ev.expand(draws, m))
    # exact conditional distribution of the free positions
    table = P.view(vocab**m, vocab ** (window - m))
    row = int(code(ev, vocab)) if ev is not None else 0
    probs = (table[row] / table[row].sum()).numpy()
    counts = np.bincount(code(x[:, m:], vocab).numpy(), minlength=probs.size)
    assert _chi2_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("evidence_len", [0, 1, 2])
@pytest.mark.parametrize(
    ("kind", "rank", "window", "vocab"), SAMPLE_CASES, ids=[f"{c[0]}-n{c[2]}" for c in SAMPLE_CASES]
)
def test_latent_path_then_its_leaves_is_an_exact_draw(
    kind: str, rank: int, window: int, vocab: int, evidence_len: int
) -> None:
    """z ~ q(z | evidence) from the sum weights and the evidence leaves only, then x_i ~ its leaf
    on z: the free positions follow q(x_{m+1..n} | x_1..x_m) (the zsample draft)."""
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab, batch=1, scale=1.0)
    P = joint_table(c, params, vocab)[0]  # (N,)
    draws, m = 20000, evidence_len
    ev = torch.randint(vocab, (1, m))
    lp = params.input_logp  # (1, n, r, V)
    leaves = lp[:, :m].gather(3, ev[:, :, None, None].expand(1, m, rank, 1)).squeeze(3)
    lw = params.sum_logw
    g = torch.Generator().manual_seed(5)
    z = c.latent_path(
        None if lw is None else lw.expand(draws, -1, -1),
        leaves.expand(draws, m, rank) if m else None,
        generator=g,
        batch_size=draws,
    )  # (draws, n)
    assert z.shape == (draws, window) and int(z.min()) >= 0 and int(z.max()) < rank
    rows = lp[0, torch.arange(window)[None, m:], z[:, m:]]  # (draws, n - m, V)
    x = torch.multinomial(rows.exp().reshape(-1, vocab), 1, generator=g).view(draws, -1)
    table = P.view(vocab**m, vocab ** (window - m))
    row = int(code(ev, vocab)) if m else 0
    probs = (table[row] / table[row].sum()).numpy()
    counts = np.bincount(code(x, vocab).numpy(), minlength=probs.size)
    assert _chi2_pvalue(counts, probs) > 1e-3


def test_most_probable_latent_path_is_the_cp_posterior_mode() -> None:
    """CP: one latent (the component); its mode given x_1..x_m is argmax_j w_j prod phi_ij."""
    c = build_circuit("cp", 4, 5)
    params = random_params(c, 3, batch=6)
    lp, lw = params.input_logp, params.sum_logw
    assert lw is not None
    for m in (0, 2):
        ev = torch.randint(3, (6, m))
        leaves = lp[:, :m].gather(3, ev[:, :, None, None].expand(6, m, 5, 1)).squeeze(3)
        want = (lw[:, 0] + leaves.sum(1)).argmax(-1)  # (B,)
        z = c.latent_path(lw, leaves, most_probable=True)
        assert torch.equal(z, want[:, None].expand(6, 4)), m


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES, ids=IDS)
def test_latent_posterior_given_a_prefix_reads_only_its_ancestors(
    kind: str, rank: int, window: int, vocab: int
) -> None:
    """Evidence on the first m positions (decoding's pending token, zsample1's first draft):
    the folds above the prefix give every unit's posterior scores, equal to the full upward
    pass; the most probable path takes each unit's best child under them, the prior's best
    without evidence. Conditionals from the prefix plan equal the layered pass's."""
    c = build_circuit(kind, window, rank)
    if c.num_sum_units == 0:
        pytest.skip("no latent")
    params = random_params(c, vocab, batch=3)
    lw = params.sum_logw
    assert lw is not None
    used = 0
    for m in range(1, window + 1):
        ev = torch.randn(3, m, rank, dtype=torch.float64) - 1.0  # (B, m, r)
        leaves = torch.cat([ev, torch.zeros(3, window - m, rank, dtype=torch.float64)], 1)
        full = c._posterior(leaves, lw, max_product=False)
        plan = c._prefix_plan(m)
        if plan is None:
            continue
        used += 1
        assert all(c.layers[lid].scopes[f][0] < m for _, (lid, f), _, _, _ in plan)
        torch.testing.assert_close(c._prefix_posterior(plan, ev, lw), full)
        z = c.latent_path(lw, ev, most_probable=True)
        assert torch.equal(z, c._walk_down(full.argmax(-1)))
    assert used >= 1  # the pending token's plan (m = 1) is always cheaper than a pass
    assert c._prefix_plan(1) is not None
    assert torch.equal(c.latent_path(lw, most_probable=True), c._walk_down(lw.argmax(-1)))


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES, ids=IDS)
def test_conditional_from_leaves_equals_the_layered_pass(
    kind: str, rank: int, window: int, vocab: int
) -> None:
    """The prefix plan's next-position conditional equals the one of a pass over every layer
    (forced by clearing the plans), for every prefix length."""
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab, batch=3)
    lp, lw = params.input_logp, params.sum_logw
    x = torch.randint(vocab, (3, window))
    leaves = lp.gather(3, x[:, :, None, None].expand(3, window, rank, 1)).squeeze(3)
    got = [c.conditional_from_leaves(leaves[:, :m], lp[:, m], lw) for m in range(window)]
    planned = sum(c._prefix_plans.get(m + 1) is not None for m in range(window))
    c._prefix_plans = dict.fromkeys(range(window + 2))  # every plan None: layered passes
    for m in range(window):
        torch.testing.assert_close(got[m], c.conditional_from_leaves(leaves[:, :m], lp[:, m], lw))
    assert planned >= (1 if c.num_sum_units else 0)


def test_sample_reproducible_with_generator() -> None:
    c = build_circuit("btree", 5, 3)
    params = random_params(c, 7, batch=4)
    a = c.sample(params, generator=torch.Generator().manual_seed(3))
    b = c.sample(params, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    full = c.sample(params, evidence=a)
    assert torch.equal(full, a)


@pytest.mark.parametrize(("kind", "rank", "window", "vocab"), CASES, ids=IDS)
def test_map_decode_and_greedy_chain(kind: str, rank: int, window: int, vocab: int) -> None:
    c = build_circuit(kind, window, rank)
    params = random_params(c, vocab)
    P = joint_table(c, params, vocab)
    for m in range(window + 1):
        ev = torch.randint(vocab, (2, m)) if m else None
        for out in (c.map_decode(params, evidence=ev), c.greedy_chain(params, evidence=ev)):
            assert out.shape == (2, window) and out.dtype == torch.long
            assert int(out.min()) >= 0 and int(out.max()) < vocab
            if ev is not None:
                assert torch.equal(out[:, :m], ev)
        # greedy chain = argmax of brute-force conditionals
        x = torch.zeros(2, 0, dtype=torch.long) if ev is None else ev
        for k in range(m, window):
            joint = prefix_table(P, window, vocab, k + 1).view(2, vocab**k, vocab)
            row = code(x, vocab) if k else torch.zeros(2, dtype=torch.long)
            x = torch.cat([x, joint[torch.arange(2), row].argmax(-1, keepdim=True)], 1)
        assert torch.equal(c.greedy_chain(params, evidence=ev), x)
    if kind == "ff" or rank == 1:  # max-product is exact MAP without latents
        assert torch.equal(c.map_decode(params), all_windows(window, vocab)[P.argmax(-1)])


def test_map_decode_is_max_over_latents_for_cp() -> None:
    c = build_circuit("cp", 3, 4)
    params = random_params(c, 4, batch=3)
    lp, lw = params.input_logp, params.sum_logw
    assert lw is not None
    best = lp.amax(-1).sum(1) + lw[:, 0]  # (B, r): best window score of each component
    z = best.argmax(-1)
    want = lp[torch.arange(3), :, z].argmax(-1)  # (B, n)
    assert torch.equal(c.map_decode(params), want)


def test_cp_rank1_equals_ff() -> None:
    ff, cp = build_circuit("ff", 4, 1), build_circuit("cp", 4, 1)
    logits = torch.randn(3, 4, 1, 5, dtype=torch.float64)
    p_ff = CircuitParams.from_logits(logits)
    p_cp = CircuitParams.from_logits(logits, torch.randn(3, 1, 1, dtype=torch.float64))
    torch.testing.assert_close(joint_table(ff, p_ff, 5), joint_table(cp, p_cp, 5))
    x = torch.randint(5, (3, 4))
    torch.testing.assert_close(ff.prefix_log_prob(p_ff, x), cp.prefix_log_prob(p_cp, x))


def test_bf16_and_fp32_inputs_are_stable() -> None:
    c = build_circuit("btree", 16, 8)
    p64 = random_params(c, 320, batch=3, scale=8.0)
    x = torch.randint(320, (3, 16))
    ref = c.prefix_log_prob(p64, x)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.5)):
        got = c.prefix_log_prob(p64.to(dtype), x)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=1e-2)
    assert torch.isfinite(c.conditional_log_prob(p64.to(torch.bfloat16), x[:, :5])).all()
    s = c.sample(p64.to(torch.bfloat16), evidence=x[:, :4])
    assert torch.equal(s[:, :4], x[:, :4])


def test_btree_any_window_and_structure() -> None:
    for n in range(1, 12):
        s = build_structure("btree", n, 2)
        assert s.layers[-1].num_units == 1
        assert sorted(p for sc in s.layers[0].scopes for p in sc) == list(range(n))
    s = build_structure("btree", 16, 4)
    assert [la.kind for la in s.layers[1:]] == ["product", "sum"] * 4  # depth log2(16)
    assert s.num_sum_rows == 14 * 4 + 1
    hmm = build_structure("hmm", 4, 3, homogeneous=True)
    assert hmm.num_param_rows == 3 + 1 and hmm.num_sum_rows == 3 * 3 + 1


def test_params_select_and_cast() -> None:
    c = build_circuit("hmm", 3, 2)
    params = random_params(c, 4, batch=5)
    x = torch.randint(4, (5, 3))
    full = c.log_prob(params, x)
    torch.testing.assert_close(c.log_prob(params[1:3], x[1:3]), full[1:3])
    torch.testing.assert_close(c.log_prob(params[2], x[2:3]), full[2:3])
    idx = torch.tensor([4, 0])
    torch.testing.assert_close(c.log_prob(params[idx], x[idx]), full[idx])
    assert params.to(torch.float32).dtype == torch.float32
    both = CircuitParams.cat([params[:2], params[2:]])
    torch.testing.assert_close(c.log_prob(both, x), full)


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("tree", 4, 2), "kind must be one of"),
        (("cp", 0, 2), "window must be"),
        (("btree", 4, 0), "rank must be"),
        (("ff", 4, 2), "rank must be 1"),
        (("cp", 4, 2.0), "rank must be"),
    ],
)
def test_bad_structure_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_structure(*args)
    with pytest.raises(ValueError, match="invalid options"):
        build_structure("cp", 4, 2, homogeneous=True)


def test_bad_query_arguments() -> None:
    c = build_circuit("btree", 4, 2)
    params = random_params(c, 5, batch=2)
    good = torch.randint(5, (2, 4))
    with pytest.raises(ValueError, match=r"x holds token ids outside \[0, 4\]"):
        c.log_prob(params, torch.full((2, 4), 5))
    with pytest.raises(ValueError, match="x holds token ids outside"):
        c.prefix_log_prob(params, torch.full((2, 4), -1))
    with pytest.raises(ValueError, match=r"x must have shape \(B=2, n=4\)"):
        c.log_prob(params, good[:, :3])
    with pytest.raises(ValueError, match=r"x must have shape"):
        c.log_prob(params, good[:1])
    with pytest.raises(ValueError, match="integer tensor"):
        c.log_prob(params, good.float())
    with pytest.raises(ValueError, match="evidence has 5 positions but must have at most 4"):
        c.sample(params, evidence=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="evidence holds token ids outside"):
        c.sample(params, evidence=torch.full((2, 2), 9))
    with pytest.raises(ValueError, match="evidence must have shape"):
        c.map_decode(params, evidence=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="prefix has 4 positions but must have at most 3"):
        c.conditional_log_prob(params, good)
    with pytest.raises(ValueError, match=r"params.input_logp must have shape \(B, n=4, r=2, V\)"):
        c.log_prob(CircuitParams(params.input_logp[:, :3], params.sum_logw), good)
    with pytest.raises(ValueError, match=r"params\.sum_logw must have shape"):
        c.log_prob(CircuitParams(params.input_logp, None), good)
    with pytest.raises(ValueError, match=r"sum_logw must have shape \(B, U=\d+, r=2\)"):
        c.latent_path(None)
    with pytest.raises(ValueError, match=r"sum_logw must have shape"):
        c.latent_path(params.sum_logw[:, :2])
    with pytest.raises(ValueError, match=r"evidence_leaves must have shape \(B=2, m<=4, r=2\)"):
        c.latent_path(params.sum_logw, torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match="params must be a CircuitParams"):
        c.log_prob(params.input_logp, good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mask must have shape"):
        c.prefix_log_prob(params, good, torch.ones(2, 3, dtype=torch.bool))
    # masked-out positions may hold any id (padding)
    mask = torch.tensor([[True, True, False, False]] * 2)
    padded = torch.where(mask, good, -100)
    torch.testing.assert_close(
        c.prefix_log_prob(params, padded, mask)[:, 1], c.prefix_log_prob(params, good)[:, 1]
    )
