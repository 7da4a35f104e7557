"""Many prompts at once (``mtpc.generate(model, prompts, batch_size=B)``) are decoded exactly.

Every row of a batched run equals the same prompt decoded alone: greedy token for token
(float64 targets, where padding cannot flip a near-tie), and sampled too, draw for draw,
because each row draws from its own generator. Rows of mixed lengths end early (stop ids),
leave the batch and give their places to waiting prompts (continuous batching); the
layout's holes are packed away. A version that shares one acceptance count across the
batch, or lets a row read another's slots, changes rows and fails. Sampling per row is
checked against the enumerated target (chi-square) at different places in the batch.
"""

from __future__ import annotations

import random

import pytest
import torch

import mtpc
from mtpc.decoding.layout import Padded
from mtpc.model import MTPCModel
from tests.fakes import (
    FAMILIES,
    SAMPLING_LENGTH,
    SAMPLING_PROMPT,
    SAMPLING_VOCAB,
    chi2_pvalue,
    exact_distribution,
    fake_evabyte,
    fake_llama3_byte,
    make_model,
    make_target,
    randomize_lora,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STOPS = (5, 7)  # rows end early, at their own cycles


def mixed_prompts(count: int, seed: int = 0, vocab: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def fields(res: mtpc.decoding.GenerationResult) -> tuple:
    return res.tokens, res.accepted, res.emitted, res.drafted, res.trunk_passes, res.stopped


def alone(model: MTPCModel, prompts: list[list[int]], new: int, **kw: object) -> list[tuple]:
    seeds = kw.pop("seed", list(range(len(prompts))))
    return [
        fields(mtpc.generate(model, p, new, seed=s, stop_ids=STOPS, **kw))  # type: ignore[arg-type]
        for p, s in zip(prompts, seeds, strict=True)  # type: ignore[call-overload]
    ]


def batched(model: MTPCModel, prompts: list[list[int]], new: int, size: int, **kw: object):
    kw.setdefault("seed", list(range(len(prompts))))
    out = mtpc.generate(model, prompts, new, stop_ids=STOPS, batch_size=size, **kw)  # type: ignore[arg-type]
    assert isinstance(out, list) and len(out) == len(prompts)
    return [fields(r) for r in out]


@pytest.mark.parametrize(
    "kind,rank",
    [pytest.param(*f, marks=[] if f[0] == "btree" else [pytest.mark.slow]) for f in FAMILIES],
)
def test_greedy_rows_equal_autoregressive_alone_for_200_prompts(kind: str, rank: int) -> None:
    """200 prompts of 1-40 ids, 64 rows at once: every row equals the batched AR row and the
    prompt's AR decoding alone; rows stop at their own end."""
    model = make_model(kind, 4, rank, k=1)
    prompts = mixed_prompts(200)
    ar_alone = alone(model, prompts, 16, method="autoregressive")
    ar = batched(model, prompts, 16, 64, method="autoregressive")
    sd = batched(model, prompts, 16, 64)
    assert [r[0] for r in ar] == [r[0] for r in ar_alone]
    assert [r[0] for r in sd] == [r[0] for r in ar_alone]
    ends = {len(r[0]) for r in sd}
    assert len(ends) > 3 and any(r[5] for r in sd)  # rows ended at different lengths
    assert len({tuple(r[1]) for r in sd}) > 20  # rows accepted their own counts


@pytest.mark.parametrize(
    "kw",
    [
        {},
        pytest.param({"policy": "recompute"}, marks=pytest.mark.slow),
        pytest.param({"policy": "drop"}, marks=pytest.mark.slow),
        {"tree_budget": 6},
        {"greedy": False},
        pytest.param(
            {"greedy": False, "policy": "recompute", "proposal": "marginal"},
            marks=pytest.mark.slow,
        ),
        pytest.param({"greedy": False, "tree_budget": 5}, marks=pytest.mark.slow),
        {"method": "autoregressive", "greedy": False},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "greedy",
)
def test_every_mode_gives_each_row_its_own_decoding(kw: dict) -> None:
    """Greedy and sampled, chains under every policy and token trees: every field of every
    row (tokens, accepted counts, passes) equals the prompt decoded alone with its seed,
    at 4 rows at once (12 prompts: places refilled) and at 12."""
    model = make_model("btree", 4, 3, k=1)
    prompts = mixed_prompts(12, seed=1)
    one = alone(model, prompts, 20, **kw)
    assert batched(model, prompts, 20, 4, **kw) == one
    assert batched(model, prompts, 20, 12, **kw) == one


def test_a_row_never_depends_on_the_others() -> None:
    """The same prompt and seed at every place of batches of different company decodes to
    the same sampled tokens."""
    model = make_model("cp", 4, 3)
    target, seed = [3, 9, 27, 1], 11
    outs = set()
    for company in range(4):
        others = mixed_prompts(5, seed=company)
        for place in (0, 2, 5):
            prompts = [*others[:place], target, *others[place:]]
            seeds = [100 + i for i in range(len(others))]
            seeds.insert(place, seed)
            res = mtpc.generate(model, prompts, 16, greedy=False, seed=seeds, stop_ids=())
            outs.add(tuple(res[place].tokens))  # type: ignore[index]
    assert len(outs) == 1


@pytest.mark.parametrize("place", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_sampled_rows_match_the_enumerated_target(place: int) -> None:
    """Speculative sampling at B = 4: the row at ``place`` (beside rows of other lengths)
    has the target's distribution over all V^L continuations (chi-square)."""
    V, L = SAMPLING_VOCAB, SAMPLING_LENGTH
    hf = make_target(vocab=V, hidden=16, seed=1, context=64)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    torch.manual_seed(2)
    model = MTPCModel.from_hf(hf, kind="btree", window=2, rank=2, head_init="random", init_std=0.5)
    probs = exact_distribution(hf, SAMPLING_PROMPT, L)
    others = [[1], [2, 3, 1, 0, 2, 2, 1], [0, 0]]
    counts = torch.zeros(V**L)
    draws = 600
    for draw in range(draws // 4):
        prompts = [*others[:place], SAMPLING_PROMPT, *others[place:]]
        prompts = [prompts[i] for i in range(4)]
        seeds = [4 * draw + i for i in range(4)]
        res = mtpc.generate(model, prompts, L, greedy=False, seed=seeds, stop_ids=())
        tokens = res[place].tokens  # type: ignore[index]
        counts[sum(t * V ** (L - 1 - i) for i, t in enumerate(tokens))] += 1
    # the same prompt decoded alone with the same seeds gives the same draws
    alone_counts = torch.zeros(V**L)
    for draw in range(draws // 4):
        tokens = mtpc.generate(
            model, SAMPLING_PROMPT, L, greedy=False, seed=4 * draw + place, stop_ids=()
        ).tokens  # type: ignore[union-attr]
        alone_counts[sum(t * V ** (L - 1 - i) for i, t in enumerate(tokens))] += 1
    assert torch.equal(counts, alone_counts)
    assert chi2_pvalue(counts, probs) > 1e-3


def test_the_byte_llama_rows_read_their_own_history() -> None:
    """The byte Llama's embedding reads each row's own id history (its expansion ids)."""
    torch.manual_seed(0)
    hf = fake_llama3_byte(2).double()
    model = MTPCModel.from_hf(hf, kind="cp", window=3, rank=2)
    prompts = mixed_prompts(8, seed=3, vocab=40)
    for kw in ({}, {"tree_budget": 4}, {"method": "autoregressive"}):
        assert batched(model, prompts, 12, 4, **kw) == alone(model, prompts, 12, **kw)


def test_the_padded_layout_packs_holes_and_rows_leave() -> None:
    """Packing the rows' slots after every pass (holes of rejected drafts and of the prompts'
    padding) keeps every row exact; rows that finish leave the batch with their slots."""
    model = make_model("cp", 4, 3)
    prompts = mixed_prompts(6, seed=4)
    layout = Padded(model)
    layout.target_slots.slack = -(10**6)  # pack the rows after every pass
    seen: list[tuple[int, int]] = []
    sizes: set[int] = set()
    keep = layout.keep

    def spy(rows, keeps):  # type: ignore[no-untyped-def]
        keep(rows, keeps)
        slots = layout.target_slots
        width, longest = slots.valid.shape[1], int(slots.lengths.max())
        seen.append((width, longest))
        sizes.add(len(layout.rows))
        assert all(b == len(layout.rows) for b in model_cache_rows(layout))

    layout.keep = spy  # type: ignore[method-assign]
    packed = []
    take = layout.target_slots.take

    def spy_take(rows):  # type: ignore[no-untyped-def]
        packed.append(rows.numel() == len(layout.rows))
        take(rows)

    layout.target_slots.take = spy_take  # type: ignore[method-assign]
    from mtpc.decoding.common import check_request, prompt_tensor
    from mtpc.decoding.loop import new_run, schedule
    from mtpc.decoding.settings import check_settings
    from mtpc.decoding.speculative import Chain

    requests, ids = [], []
    for p in prompts:
        x = prompt_tensor(model, p)
        requests.append(check_request(model, x, check_settings(max_new_tokens=60, stop_ids=())))
        ids.append(x[0])
    results = schedule(new_run(model, requests[0], Chain(requests[0])), ids, requests, layout, 6)
    assert all(w == n for w, n in seen)  # packed: no slot beyond the longest row
    assert sum(packed) >= len(seen)  # packed after every pass, and still exact
    assert len(sizes) > 1  # rows left the batch as they finished
    assert [r.tokens for r in results] == [
        mtpc.generate(model, p, 60, stop_ids=()).tokens  # type: ignore[union-attr]
        for p in prompts
    ]


def model_cache_rows(layout: Padded) -> list[int]:
    """The batch size of the trunk cache's filled layers (empty when nothing is cached)."""
    native = layout.caches.trunk.native
    return [layer.keys.shape[0] for layer in native.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]  # fmt: skip


def test_bad_batches_fail_before_decoding() -> None:
    model = make_model("cp", 4, 3)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        mtpc.generate(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match=r"the prompt has 130 tokens"):
        mtpc.generate(model, [[1, 2], [1] * 130], 4)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] contains id 99"):
        mtpc.generate(model, [[99], [1]], 4)
    with pytest.raises(ValueError, match="batch_size is 0; allowed: an int >= 1"):
        mtpc.generate(model, [[1], [2]], 4, batch_size=0)
    with pytest.raises(ValueError, match="seed has 3 values for 2 prompts"):
        mtpc.generate(model, [[1], [2]], 4, seed=[1, 2, 3])
    # a batch larger than the prompts decodes them all, one result each, in order
    out = mtpc.generate(model, [[1, 2], [3]], 4, batch_size=16, stop_ids=())
    assert [r.tokens for r in out] == [  # type: ignore[union-attr]
        mtpc.generate(model, p, 4, stop_ids=()).tokens  # type: ignore[union-attr]
        for p in ([1, 2], [3])
    ]


@pytest.mark.parametrize("kw", [{}, {"greedy": False, "tree_budget": 5}], ids=["greedy", "tree"])
def test_evabyte_batches_rows_in_their_own_windows_each_equal_to_alone(kw: dict) -> None:
    """EvaByte (the uncompiled static engine, window 8: rows cross window boundaries at
    their own steps): a batch of 3 (prompts replaced) and a list (None: all at once) equal
    each prompt alone. The real remote code: tests/test_evabyte_batch.py."""
    hf = fake_evabyte(2, window_size=8, chunk_size=4)
    model = MTPCModel.from_hf(hf, kind="cp", window=4, rank=2, lora_layers=1)
    randomize_lora(model)
    prompts = mixed_prompts(5, seed=3)
    want = alone(model, prompts, 20, **kw)
    assert batched(model, prompts, 20, 3, **kw) == want
    assert batched(model, prompts, 20, None, **kw) == want  # type: ignore[arg-type]


def test_a_finished_rows_place_goes_to_a_waiting_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Continuous batching: with 2 places and 5 prompts, prompts are admitted while other
    rows are still decoding (a version that waits for the whole batch admits only into an
    empty one), and every prompt still equals its decoding alone."""
    model = make_model("cp", 4, 3)
    prompts = mixed_prompts(5, seed=6)
    held: list[int] = []
    admit = Padded.admit

    def spy(self: Padded, rows, prompts):  # type: ignore[no-untyped-def]
        held.append(len(self.rows))
        return admit(self, rows, prompts)

    monkeypatch.setattr(Padded, "admit", spy)
    assert batched(model, prompts, 12, 2) == alone(model, prompts, 12)
    assert held[0] == 0 and any(h > 0 for h in held[1:])
