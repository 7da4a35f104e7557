"""The counter-based random stream (``mtpc.decoding.draws``) and the batched acceptance.

A row's draws are a pure function of its seed and output positions: its sampled output is
the same alone, at a place of a batch of 8 and admitted mid-run in place of a finished row
(a stream keyed by the row's place, or one shared by the rows, fails). The uniforms are
uniform (Kolmogorov-Smirnov over 10^5 draws) and distinct keys give uncorrelated streams.
The chain's batched acceptance (rows of different draft lengths, padded) equals a per-row
scalar reference on random p, q: greedy, sampled with q as a vector and computed on demand,
and ``max_throughput``; the autoregressive and tree draws read the same stream.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import kstest

import mtpc
from mtpc.decoding.common import TargetRule
from mtpc.decoding.draws import ACCEPT, DRAFT, EMIT, LATENT, Draws, row_key
from mtpc.decoding.layout import Padded
from mtpc.decoding.loop import Proposal
from mtpc.decoding.speculative import Chain, Draft
from mtpc.decoding.verify import residual, verify_greedy
from tests.fakes import make_model

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET, SEED = [3, 9, 27, 1, 4], 11
STOPS = (5, 7)  # rows end at their own cycles
OTHERS = [[1], [2, 5, 8, 13, 21, 34], [7, 7], [40, 2, 9], [11, 12, 13, 14], [6], [30, 31]]


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("cp", {}),
        ("cp", {"proposal": "marginal"}),
        ("cp", {"proposal": "path"}),
        ("ff", {}),
        ("cp", {"tree_budget": 5}),
        ("cp", {"method": "autoregressive"}),
    ],
    ids=["first_marginal", "marginal", "path", "ff", "tree", "ar"],
)
def test_a_rows_sampled_output_is_the_same_alone_in_a_batch_and_admitted_mid_run(
    kind: str, kw: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same prompt and seed: alone (place 0), at place 5 of 8 rows of other seeds, and
    the last of 8 prompts at 3 places (admitted while other rows decode, in the place of a
    finished one; rows end at their own stop ids): the same sampled tokens and counts."""
    model = make_model(kind, 4, 3 if kind == "cp" else 1)

    def run(prompts: list[list[int]], seeds: list[int], size: int, place: int) -> tuple:
        out = mtpc.generate(
            model, prompts, 24, greedy=False, seed=seeds, stop_ids=STOPS, batch_size=size, **kw
        )
        res = out[place]  # type: ignore[index]
        return res.tokens, res.accepted

    alone = run([TARGET], [SEED], 1, 0)
    seeds = [100 + i for i in range(7)]
    in_eight = run([*OTHERS[:5], TARGET, *OTHERS[5:]], [*seeds[:5], SEED, *seeds[5:]], 8, 5)
    held: list[int] = []
    admit = Padded.admit

    def spy(self: Padded, rows, prompts):  # type: ignore[no-untyped-def]
        held.append(len(self.rows))
        return admit(self, rows, prompts)

    monkeypatch.setattr(Padded, "admit", spy)
    replacing = run([*OTHERS, TARGET], [*seeds, SEED], 3, 7)
    assert held[-1] > 0  # the last prompt joined rows still decoding
    assert alone == in_eight == replacing
    assert len(alone[0]) > 5


def test_the_uniforms_are_uniform_and_distinct_keys_are_uncorrelated() -> None:
    """10^5 draws of 1,000 rows: KS against U(0, 1); the streams of neighbouring seeds, of
    neighbouring starts, of neighbouring slots and of neighbouring indices: |corr| < 0.015
    (4 standard errors at 10^5 pairs); every value in [0, 1)."""
    cpu = torch.device("cpu")
    rows, k = 1000, 100
    base = Draws([row_key(s) for s in range(rows)], [0] * rows, cpu)
    u = base.take(DRAFT, k)  # (rows, k)
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    assert len(set(u.flatten().tolist())) == rows * k  # no repeats among 10^5 53-bit values
    seeds = Draws([row_key(s + 1) for s in range(rows)], [0] * rows, cpu).take(DRAFT, k)
    starts = Draws([row_key(s) for s in range(rows)], [1] * rows, cpu).take(DRAFT, k)
    others = {
        "seed": seeds,
        "start": starts,
        "slot": base.take(ACCEPT, k),
        "latent": base.take(LATENT, k),
        "index": torch.roll(u, 1, 1),
        "big seed": Draws([row_key(s + 2**32) for s in range(rows)], [0] * rows, cpu).take(
            DRAFT, k
        ),
    }
    for name, v in others.items():
        corr = torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1]
        assert abs(float(corr)) < 0.015, name
        assert not torch.equal(u, v), name
    # a row's draws do not depend on the other rows of the table
    one = Draws([row_key(37)], [0], cpu).take(DRAFT, k)
    assert torch.equal(one[0], u[37])
    index = torch.arange(rows) % k
    assert torch.equal(base.at(DRAFT, index), u[torch.arange(rows), index])
    # a cycle's table (every slot hashed at once) holds the same draws
    keys = [row_key(s) for s in range(rows)]
    table = Draws(keys, [0] * rows, cpu, {LATENT: 3, DRAFT: k, EMIT: 9})
    assert torch.equal(table.take(DRAFT, k), u)
    assert torch.equal(table.at(DRAFT, index), u[torch.arange(rows), index])
    assert torch.equal(table.take(LATENT, 2), base.take(LATENT, 2))
    assert torch.equal(table.at(EMIT, index % 9), base.at(EMIT, index % 9))
    assert torch.equal(table.take(ACCEPT, 4), base.take(ACCEPT, 4))  # not in the table


def reference(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> tuple:
    """One row's speculative sampling, scalar by scalar: s and the distribution of the
    correction (the residual) or the bonus (p_m)."""
    m = x.shape[0]
    for i in range(m):
        qi, pi = float(q[i, x[i]]), float(p[i, x[i]])
        if qi > 0 and float(u[i]) >= pi / qi:
            return i, residual(p[i], q[i].to(p.dtype))
    return m, p[m]


def inverse(weights: torch.Tensor, u: float) -> int:
    """The first entry whose cumulative sum exceeds u times the total, summed one by one."""
    cdf, total = 0.0, float(weights.double().sum())
    for token, w in enumerate(weights.double().tolist()):
        cdf += w
        if cdf > u * total:
            return token
    return len(weights) - 1


def batch(seed: int, n: int = 5, V: int = 6) -> tuple[list, list, list, list]:
    """Random rows of 0..n drafts: target logits (m + 1, V), q (m, V), drafts (m,) drawn
    from q (or the target's argmax, for greedy acceptances), pending or not."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(8):
        m = [0, n, 1, n, 2, n - 1, n, 3][b]
        target = 2 * torch.randn(m + 1, V, generator=g)
        q = torch.softmax(2 * torch.randn(m, V, generator=g), -1)
        if seed % 2:  # drafts that often match the target's argmax
            x = target[:m].argmax(-1)
            flip = torch.rand(m, generator=g) < 0.3
            x = torch.where(flip, torch.randint(V, (m,), generator=g), x)
        else:
            x = (
                torch.multinomial(q, 1, generator=g)[:, 0]
                if m
                else torch.zeros(0, dtype=torch.long)
            )
        rows.append((target, q, x, b % 2))
    targets = [t for t, _, _, _ in rows]
    qs = [q for _, q, _, _ in rows]
    xs = [x for _, _, x, _ in rows]
    pres = [pre for _, _, _, pre in rows]
    return targets, qs, xs, pres


@pytest.mark.parametrize("mode", ["greedy", "vector", "lazy", "throughput", "throughput-greedy"])
def test_the_batched_acceptance_equals_the_per_row_reference(mode: str) -> None:
    """200 batches of 8 rows of 0..5 drafts (padded), with and without a pending token:
    ``Chain.verify_rows`` gives every row the reference's (s, token) and its outcome's keep
    and after; on demand, q is asked only where u_i >= p_i(x_i), up to the first rejection."""
    greedy = mode in ("greedy", "throughput-greedy")
    rule = TargetRule(greedy=greedy, top_k=5 if mode == "vector" else None)
    request = SimpleNamespace(max_throughput=mode.startswith("throughput"))
    run = SimpleNamespace(rule=rule, request=request)
    chain = Chain.__new__(Chain)
    rejections = asked_total = 0
    for trial in range(200):
        targets, qs, xs, pres = batch(trial)
        draws = Draws(
            [row_key(trial * 8 + b) for b in range(8)], list(range(8)), torch.device("cpu")
        )
        asked: list[list[int]] = [[] for _ in range(8)]
        proposals = []
        for b, (q, x, pre) in enumerate(zip(qs, xs, pres, strict=True)):
            q_tok = q[torch.arange(x.shape[0]), x]

            def ask(i: int, q_tok: torch.Tensor = q_tok, seen: list[int] = asked[b]) -> float:
                seen.append(i)
                return float(q_tok[i])

            token_probs = ask if mode == "lazy" else q_tok
            ids = torch.cat([torch.tensor([5] * pre, dtype=torch.long), x])[None]
            proposals.append(Proposal(ids, pre, Draft(ids, token_probs, q.__getitem__)))
        outcomes = chain.verify_rows(run, [None] * 8, proposals, targets, draws)  # type: ignore[arg-type]
        u = draws.take(ACCEPT, 5)
        for b, outcome in enumerate(outcomes):
            m, x = xs[b].shape[0], xs[b]
            p = rule.probs(targets[b])  # (m + 1, V)
            if greedy:
                verdict = verify_greedy(rule.argmax(targets[b]), x)
                s, token = verdict.accepted, verdict.next_token
                if request.max_throughput:
                    s, token = m, int(rule.argmax(targets[b][m]))
            else:
                s, dist = (m, p[m]) if request.max_throughput else reference(p, qs[b], x, u[b])
                token = inverse(dist, float(draws.at(EMIT, torch.full((8,), s))[b]))
            if mode == "lazy":
                unsure = [i for i in range(m) if float(u[b, i]) >= float(p[i, x[i]])]
                assert asked[b] == [i for i in unsure if i <= s]
                asked_total += len(asked[b])
            rejections += s < m
            assert (outcome.accepted, outcome.token) == (x[:s].tolist(), token), (trial, b)
            assert (outcome.keep, outcome.after, outcome.drafted) == (pres[b] + s, s, m)
    assert rejections > 100 or request.max_throughput
    assert mode != "lazy" or asked_total > 0


def test_a_broken_key_changes_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check with a stream keyed by the row's place in the batch, then with one
    stream shared by all rows: the row decoded alone and in a batch differ (the test above
    can tell)."""
    from mtpc.decoding import loop

    model = make_model("cp", 4, 3)

    def both() -> tuple[list[int], list[int]]:
        alone = mtpc.generate(model, TARGET, 24, greedy=False, seed=SEED, stop_ids=())
        seeds = [100 + i for i in range(7)]
        out = mtpc.generate(
            model, [*OTHERS[:5], TARGET, *OTHERS[5:]], 24, greedy=False,
            seed=[*seeds[:5], SEED, *seeds[5:]], stop_ids=(),
        )  # fmt: skip
        return alone.tokens, out[5].tokens  # type: ignore[union-attr, index]

    a, b = both()
    assert a == b
    for broken in ("place", "shared"):

        def draws(run, rows, broken=broken):  # type: ignore[no-untyped-def]
            keys = [row_key(i) if broken == "place" else rows[0].key for i in range(len(rows))]
            starts = [len(row.res.tokens) for row in rows]
            return Draws(keys, starts, torch.device("cpu"))

        monkeypatch.setattr(loop, "cycle_draws", draws)
        a, b = both()
        assert a != b, broken
