"""Self-speculative decoding is exactly the target's greedy decoding (and bad input fails early).

Greedy: every family x n in {1, 2, 4, 8} x k in {0, 1} x policy {condition, recompute} on
several prompts equals autoregressive greedy decoding token for token, which equals
``transformers``' own ``generate(do_sample=False)``. Stub drafters that know the answer force
all-accept, all-reject and reject-at-position-i, so every branch of a cycle runs (crops,
bonus token, empty kept states); a spy checks the trunk cache's id history after every crop.
Targets are float64 so that near-ties cannot flip an argmax between a one-token and a
window pass.
"""

from __future__ import annotations

import pytest
import torch

import mtpc
from mtpc.decoding import POLICIES
from mtpc.model import MTPCModel
from tests.fakes import FAMILIES, PROMPTS, generate_with_rule, make_model, oracle

V = 48  # make_target's vocabulary
NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_greedy(model: MTPCModel, prompt: list[int], new: int) -> list[int]:
    out = model.backbone.hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
@pytest.mark.parametrize("kind,rank", FAMILIES)
def test_greedy_equals_autoregressive_and_transformers(
    kind: str, rank: int, window: int, k: int
) -> None:
    model = make_model(kind, window, rank, k)
    for i, prompt in enumerate(PROMPTS):
        ar = mtpc.generate(model, prompt, NEW, method="autoregressive", stop_ids=())
        assert len(ar.tokens) == NEW
        if window == 4 and kind == "cp":  # the oracle once per k (AR does not depend on the head)
            assert ar.tokens == hf_greedy(model, prompt, NEW)
        runs = [("condition", None), ("recompute", None), ("condition", "zsample")]
        for policy, mode in runs:  # None: the default (zmap, the latent-path greedy draft)
            sd = generate_with_rule(model, prompt, NEW, mode, policy=policy, stop_ids=())
            assert sd.tokens == ar.tokens, (kind, window, k, policy, mode, i)
            assert sum(sd.emitted) == NEW
            assert all(0 <= a <= window for a in sd.accepted)


@pytest.mark.parametrize("mode", ["sample", "map", "chain", "zmap", "zsample", "zsample1"])
@pytest.mark.parametrize("kind,rank", FAMILIES)
def test_every_greedy_draft_mode_and_drop_are_exact(kind: str, rank: int, mode: str) -> None:
    model = make_model(kind, 4, rank, k=1)
    prompt = PROMPTS[0]
    ar = mtpc.generate(model, prompt, NEW, method="autoregressive", stop_ids=())
    for policy in POLICIES:
        sd = generate_with_rule(model, prompt, NEW, mode, policy=policy, stop_ids=())
        assert sd.tokens == ar.tokens, (kind, mode, policy)


@pytest.mark.parametrize(
    "mode,greedy", [("zmap", True), ("zsample", False), ("zsample1", False), ("sample", False)]
)
@pytest.mark.parametrize("kind,rank", FAMILIES)
def test_latent_path_drafts_never_evaluate_the_whole_table(
    kind: str, rank: int, mode: str, greedy: bool
) -> None:
    """zmap / zsample read r rows of W at the pending token's position (none when r = 1)
    and one row per drafted position; sample adds every unit of the positions its tests
    ask q at, zsample1 every unit of the first draft's position when its test asks; the
    whole (n, r, V) table is refused."""
    n = 4
    model = make_model(kind, n, rank)
    head = model.head
    real = head.input_logits
    rows: list[int] = []

    def counting(e: torch.Tensor, positions=None, units=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if positions is None:
            raise AssertionError("the draft evaluated the whole table")
        rows.append(len(positions) * (1 if units is not None else rank))
        return real(e, positions, units)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the draft evaluated the whole table")

    real_tokens = head.token_logits
    pairs: list[int] = []

    def counting_tokens(e: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor):  # type: ignore[no-untyped-def]
        pairs.append(len(positions))
        return real_tokens(e, positions, tokens)

    head.input_logits = counting  # type: ignore[method-assign]
    head.token_logits = counting_tokens  # type: ignore[method-assign]
    head.forward = refuse  # type: ignore[method-assign]
    model.draft_params = refuse  # type: ignore[method-assign]
    res = generate_with_rule(model, PROMPTS[0], NEW, mode, greedy=greedy, stop_ids=())
    cycles = res.num_cycles
    # zmap scores the pending token's units by r d-vectors of W (token_logits), not rows
    evidence_rows = rank if rank > 1 and mode != "zmap" else 0
    assert sum(pairs) == (cycles - 1 if rank > 1 and mode == "zmap" else 0)
    # first cycle: nothing pending, n leaves; then the pending token + n - 1 leaves
    path_rows = n + (cycles - 1) * (evidence_rows + n - 1)
    if mode == "sample" and rank > 1:
        assert path_rows <= sum(rows) <= path_rows + cycles * n * rank
    elif mode == "zsample1" and rank > 1:  # + every unit at the first draft when asked
        assert path_rows < sum(rows) <= path_rows + cycles * rank
        assert (sum(rows) - path_rows) % rank == 0
    else:
        assert sum(rows) == path_rows
        assert len(rows) == 1 + (cycles - 1) * (2 if evidence_rows else 1)
    if greedy:
        ar = mtpc.generate(model, PROMPTS[0], NEW, method="autoregressive", stop_ids=())
        assert res.tokens == ar.tokens


@torch.no_grad()
def test_the_marginal_proposal_reads_only_the_positions_it_is_asked() -> None:
    """q_i needs every unit at positions <= i and nothing after; it equals the full table's."""
    from mtpc.decoding.speculative import HeadState, MarginalProposal

    n, r = 4, 3
    model = make_model("btree", n, r)
    hidden = torch.randn(1, 32, dtype=torch.float64)
    window = torch.tensor([[3, 8, 1, 40]])
    state = HeadState(model, hidden)
    seen: list[list[int]] = []
    real = model.head.input_logits

    def spy(e: torch.Tensor, positions=None, units=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        seen.append(list(range(n)) if positions is None else [int(p) for p in positions])
        return real(e, positions, units)

    model.head.input_logits = spy  # type: ignore[method-assign]
    marginal = MarginalProposal(state, window, pre=1)
    q1 = marginal.token_prob(0)  # q(x_2 | x_1): positions 0 and 1
    assert seen == [[0, 1]]
    q2 = marginal.token_prob(1)
    assert seen == [[0, 1], [2]]
    full = HeadState(model, hidden).params()
    prefix = model.head.circuit.prefix_log_prob(full, window)[0]
    torch.testing.assert_close(torch.tensor([q1, q2]), (prefix[1:3] - prefix[0:2]).exp())
    cond = model.head.circuit.conditional_log_prob(full, window[:, :2])[0].exp()
    torch.testing.assert_close(marginal.dist(1), cond)
    assert seen == [[0, 1], [2], list(range(n))]  # (the last: the full table, for the check)


@torch.no_grad()
def test_zsample1_verifies_its_first_draft_against_the_marginal() -> None:
    """zsample1's proposal at the first draft is the circuit's marginal q(. | pending token)
    (a version verifying against the path's q(. | z), as zsample does, fails), and q(. | z)
    at the later drafts."""
    from mtpc.decoding.speculative import HeadState, draft_step

    n, r = 4, 3
    model = make_model("btree", n, r)
    hidden = torch.randn(1, 32, dtype=torch.float64)
    evidence = torch.tensor([[7]])
    full = HeadState(model, hidden).params()
    marginal = model.head.circuit.conditional_log_prob(full, evidence)[0].exp()  # (V,)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        draft = draft_step(HeadState(model, hidden), evidence, "zsample1", g, sampling=True)
        g = torch.Generator().manual_seed(seed)
        path = draft_step(HeadState(model, hidden), evidence, "zsample", g, sampling=True)
        assert torch.equal(draft.window, path.window)  # the same draw
        assert callable(draft.token_probs) and draft.proposal is not None
        assert path.proposal is not None and isinstance(path.token_probs, torch.Tensor)
        x1 = int(draft.window[0, 1])
        torch.testing.assert_close(draft.proposal(0), marginal)
        assert draft.token_probs(0) == pytest.approx(float(marginal[x1]))
        for i in range(1, n - 1):
            torch.testing.assert_close(draft.proposal(i), path.proposal(i))
            assert draft.token_probs(i) == pytest.approx(float(path.token_probs[i]))
        assert not torch.allclose(path.proposal(0), marginal)  # the test can tell them apart


def test_a_draft_that_predicts_the_target_gets_accepted() -> None:
    """Position 1 of a head initialised from the STP head is the verifier itself (k = 0)."""
    model = make_model("cp", 4, 2, k=0, noise=0.0)
    sd = mtpc.generate(model, PROMPTS[0], NEW, stop_ids=())
    assert sd.accepted[0] >= 1  # the first window's first draft is the target's argmax


# --- stub drafters (tests/fakes.oracle): every branch of the cycle ----------------------------


def spy_trunk_history(model: MTPCModel, reference: list[int]) -> list[int]:
    """Checks, at every trunk call, that the cached id history is the true prefix."""
    calls: list[int] = []
    trunk = model.trunk

    def spy(ids: torch.Tensor, cache=None, positions=None):  # type: ignore[no-untyped-def]
        if cache is not None and cache.ids is not None:
            assert cache.ids[0].tolist() == reference[: len(cache)], "a crop kept a rejected id"
            assert len(cache.ids[0]) == len(cache)
        calls.append(ids.shape[1])
        return trunk(ids, cache, positions)

    model.trunk = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize(
    "case,wrong_from", [("all-accept", None), ("all-reject", 0), ("reject-at-1", 1), ("reject-at-2", 2), ("reject-at-3", 3)]
)  # fmt: skip
def test_stub_drafts_cover_every_branch(
    case: str, wrong_from: int | None, k: int, policy: str
) -> None:
    n = 4
    model = make_model("btree", n, 2, k)
    prompt = PROMPTS[0]
    ar = mtpc.generate(model, prompt, NEW, method="autoregressive", stop_ids=()).tokens
    reference = prompt + ar
    calls = spy_trunk_history(model, reference)
    sd = mtpc.generate(
        model, prompt, NEW, policy=policy, stop_ids=(), drafter=oracle(reference, n, wrong_from)
    )
    assert sd.tokens == ar
    body = list(zip(sd.accepted, sd.offsets, strict=True))[:-1]  # the last cycle may be cut short
    for s, pre in body:
        m = n - pre
        expected = m if wrong_from is None else max(0, min(m, wrong_from - pre))
        assert s == expected, (case, policy, sd.accepted, sd.offsets)
    if policy == "condition":
        assert sd.offsets[0] == 0 and all(o == 1 for o in sd.offsets[1:])
        assert sd.trunk_passes == len(sd.accepted) == len(calls) - 1
        assert all(e == a + 1 for a, e in zip(sd.accepted[:-1], sd.emitted[:-1], strict=True))
    if policy == "recompute":
        assert all(o == 0 for o in sd.offsets)
        assert sd.trunk_passes == 2 * len(sd.accepted) - 1  # one extra pass per cycle but the last
    if policy == "drop" and wrong_from is None:
        assert all(e == n for e in sd.emitted[:-1])  # bonus dropped, window re-verified


def test_max_throughput_accepts_every_draft() -> None:
    model = make_model("cp", 4, 2)
    sd = mtpc.generate(model, PROMPTS[0], NEW, max_throughput=True, stop_ids=())
    assert all(s == d for s, d in zip(sd.accepted, sd.drafted, strict=True))
    assert len(sd.tokens) == NEW


def test_stop_ids_end_generation_and_suppress_eos_forbids_them() -> None:
    model = make_model("cp", 4, 2)
    free = mtpc.generate(model, PROMPTS[0], NEW, method="autoregressive", stop_ids=()).tokens
    stop = free[5]
    first = free.index(stop)
    for method in ("autoregressive", "speculative"):
        res = mtpc.generate(model, PROMPTS[0], NEW, method=method, stop_ids=[stop])
        assert res.tokens == free[: first + 1] and res.stopped
        res = mtpc.generate(
            model, PROMPTS[0], NEW, method=method, stop_ids=[stop], suppress_eos=True
        )
        assert stop not in res.tokens and len(res.tokens) == NEW and not res.stopped
    ar = mtpc.generate(model, PROMPTS[0], NEW, "autoregressive", stop_ids=[stop], suppress_eos=True)
    sd = mtpc.generate(model, PROMPTS[0], NEW, stop_ids=[stop], suppress_eos=True)
    assert sd.tokens == ar.tokens


def test_result_records_timings_and_breakdown() -> None:
    model = make_model("hmm", 4, 2, k=1)
    res = mtpc.generate(model, torch.tensor(PROMPTS[0]), NEW, stop_ids=(), profile=True)
    assert len(res.cycle_seconds) == len(res.accepted) == len(res.emitted)
    assert res.seconds >= sum(res.cycle_seconds) > 0
    assert res.breakdown is not None and set(res.breakdown) >= {
        "model",
        "head",
        "circuit",
        "overhead",
    }
    assert sum(res.breakdown.values()) == pytest.approx(sum(res.cycle_seconds), rel=1e-6)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"prompt_ids": []}, "prompt_ids is empty"),
        (
            {"prompt_ids": torch.zeros(2, 3, dtype=torch.long)},
            "one prompt; a list of prompts for many",
        ),
        ({"prompt_ids": [1, V]}, "allowed: 0..47"),
        ({"prompt_ids": list(range(1, 40)) * 4}, "context is 128"),
        ({"max_new_tokens": 120}, "exceeds the target's context"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is not allowed"),
        ({"policy": "keep"}, "policy='keep' is not allowed; allowed: condition, recompute, drop"),
        ({"method": "beam"}, "method='beam' is not allowed"),
        ({"draft": "argmax"}, "draft='argmax' is not allowed; allowed: path, map, chain, tree"),
        ({"draft": "map", "greedy": False}, "draft='map' is not allowed with greedy=False"),
        ({"draft": "chain", "greedy": False}, "draft='chain' is not allowed with greedy=False"),
        ({"greedy": False, "temperature": 0.0}, "temperature=0.0 is not allowed"),
        ({"greedy": False, "top_p": 1.5}, "top_p=1.5 is not allowed"),
        ({"top_k": 0}, "top_k=0 is not allowed"),
        ({"stop_ids": [V + 3]}, "stop_ids contains 51"),
    ],
)
def test_bad_input_fails_before_decoding(kwargs: dict, match: str) -> None:
    model = make_model("cp", 4, 2)
    calls = spy_trunk_history(model, [])
    args = {"prompt_ids": PROMPTS[0], "max_new_tokens": 8, "stop_ids": (), **kwargs}
    with pytest.raises(ValueError, match=match):
        mtpc.generate(model, **args)
    assert calls == []  # nothing ran
