"""Token trees on the static engine (``StaticLayout`` with ``widest``, issue 41): one tree
pass of a fixed T (the budget + 1) under each row's ancestor mask and depths, and ``keep``'s
compaction of the accepted path's keys and values to the pass's first slots
(``StaticEngine.compact``). Compiled trees equal the eager trees field for field, the graphs
do not recompile for new prompt lengths, a rejected node's slot is never read after ``keep``
(and a compaction that leaves the path in place is caught). EvaByte's trees on its engine:
tests/test_evabyte_static.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

import mtpc
from mtpc.decoding.settings import c_compiler
from mtpc.decoding.static import StaticEngine, StaticLayout
from mtpc.model import MTPCModel
from tests.fakes import make_model
from tests.test_static_decode import (
    CHAIN_MODES,
    chain_prompts,
    graphs,
    no_fallback,
    poison_past_lengths,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 16  # nodes per tree: a pass of T = 17 ids per row


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and counts only its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled_trees(
    model: MTPCModel, prompts: list[list[int]], new: int, backend: str, size: int, **kw: object
) -> list:  # type: ignore[type-arg]
    """``mtpc.generate`` of token trees (``BUDGET`` nodes) on the static engine."""
    kw = {"tree_budget": BUDGET, "seed": list(range(len(prompts))), **kw}
    return mtpc.generate(model, prompts, new, batch_size=size, compile=backend, **kw)  # type: ignore[arg-type]


def eager_trees(model: MTPCModel, prompts: list[list[int]], new: int, size: int, **kw: object):  # type: ignore[no-untyped-def]
    """The eager layouts' results of the same call (``mtpc.generate``)."""
    kw = {"tree_budget": BUDGET, "seed": list(range(len(prompts))), **kw}
    return mtpc.generate(model, prompts, new, batch_size=size, **kw)  # type: ignore[arg-type]


FIELDS = ("tokens", "accepted", "emitted", "drafted", "offsets", "trunk_passes", "nodes")


def same_rows(eager: list, compiled: list) -> None:  # type: ignore[type-arg]
    """Row by row, every per-cycle field of the eager trees' results (the trees' expected
    acceptance to 1e-6: inductor's fused kernels round the head's inputs otherwise)."""
    for field in FIELDS:
        assert [getattr(r, field) for r in compiled] == [getattr(r, field) for r in eager], field
    for a, b in zip(compiled, eager, strict=True):
        assert len(a.expected) == len(b.expected)
        for x, y in zip(a.expected, b.expected, strict=True):
            assert x == pytest.approx(y, abs=1e-6)
    assert {r.engine for r in compiled} == {"compiled"}
    assert {r.engine for r in eager} == {"eager"}


def moved_paths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts, per compaction, the rows whose kept path is not a prefix of the pass."""
    original, moved = StaticEngine.compact, []

    def compact(self: StaticEngine, places, base, keep) -> None:  # type: ignore[no-untyped-def]
        span = torch.arange(keep.shape[1], device=keep.device)
        moved.append(int((keep != span).any(1).sum()))
        original(self, places, base, keep)

    monkeypatch.setattr(StaticEngine, "compact", compact)
    return moved


@pytest.mark.parametrize(
    ("kind", "k", "size"),
    [
        pytest.param("btree", 1, 1, marks=pytest.mark.slow),
        ("btree", 1, 8),
        pytest.param("cp", 0, 1, marks=pytest.mark.slow),
        pytest.param("cp", 0, 8, marks=pytest.mark.slow),
    ],
)  # the quick set keeps one batch (BTree with a LoRA tail); CI runs all
def test_compiled_trees_equal_eager(
    kind: str, k: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token trees of 16 nodes on the engine (float64 fakes, a BTree draft with a LoRA tail
    and a CP draft reading the trunk's state): every policy, greedy and sampled (each row its
    own seed), B = 1 and B = 8 of 10 prompts (rows replaced); every row equals the eager
    trees field for field (tokens, accepted nodes per cycle, nodes, passes, ...), accepted
    paths off the pass's prefix were compacted, and the graphs are one per shape."""
    model = make_model(kind, 4, 2 if kind == "btree" else 3, k=k)
    prompts = chain_prompts(6, (3, 9, 40, 17, 70, 5, 33, 1, 12, 25)[: 6 if size == 1 else 10])
    backend = "aot_eager" if (kind, size) == ("btree", 1) else "eager"
    moved = moved_paths(monkeypatch)
    sampled = {}
    for policy, greedy in CHAIN_MODES:
        kw = {"policy": policy, "greedy": greedy, "stop_ids": ()}
        eager = eager_trees(model, prompts, 24, size, **kw)
        with no_fallback():
            compiled = compiled_trees(model, prompts, 24, backend, size, **kw)
        same_rows(eager, compiled)
        sampled[greedy] = [r.tokens for r in compiled]
    assert sampled[True] != sampled[False]
    assert sum(moved) > 20  # accepted paths that were not the pass's first nodes
    # the tree pass (T = 17), T = 1 (recompute), the prefill chunk; the tail's 5 and chunk
    assert graphs() == (5 if k else 3) and not counters["graph_break"]


def test_trees_do_not_recompile_for_new_prompt_lengths() -> None:
    """After a warm-up (B = 1 and B = 5), five prompts of other lengths decode their trees
    (a LoRA tail: four graphs per batch size) with the graphs compiled already."""
    model = make_model("btree", 4, 2, k=1)
    kw = {"stop_ids": ()}
    compiled_trees(model, chain_prompts(1, (40,)), 8, "eager", 1, **kw)
    compiled_trees(model, chain_prompts(1, (40,) * 5), 8, "eager", 5, **kw)
    assert graphs() == 8 and not counters["graph_break"]  # (chunk, T = 17) x (trunk, tail) x 2 B
    prompts = chain_prompts(3, (1, 31, 33, 64, 100))
    with torch._dynamo.config.patch(error_on_recompile=True), no_fallback():
        alone = [compiled_trees(model, [p], 20, "eager", 1, **kw)[0] for p in prompts]
        batch = compiled_trees(model, prompts, 20, "eager", 5, **kw)
    assert graphs() == 8
    assert {r.engine for r in [*alone, *batch]} == {"compiled"}
    assert [r.tokens for r in alone] == [r.tokens for r in batch]
    assert [r.tokens for r in batch] == [r.tokens for r in eager_trees(model, prompts, 20, 5, **kw)]


@pytest.mark.parametrize("policy", [pytest.param("recompute", marks=pytest.mark.slow), "condition"])
def test_rejected_nodes_are_never_read(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After every keep, huge keys and values go into every slot past each row's length (the
    rejected nodes' and the accepted path's old slots, trunk and cache D): the rows still
    equal the eager trees. A compaction that leaves the accepted nodes in their slots (the
    lengths rewound over the pass's first nodes instead) changes the tokens."""
    model = make_model("btree", 4, 2, k=1)
    prompts = chain_prompts(4)
    kw = {"policy": policy, "stop_ids": ()}
    eager = eager_trees(model, prompts, 24, 3, **kw)
    original, poisoned = StaticLayout.keep, []

    def keep(self: StaticLayout, rows, keeps) -> None:  # type: ignore[no-untyped-def]
        original(self, rows, keeps)  # then poisons the slots past the rows' lengths
        poisoned.append(poison_past_lengths(self, self.widest))

    monkeypatch.setattr(StaticLayout, "keep", keep)
    moved = moved_paths(monkeypatch)
    with no_fallback():
        compiled = compiled_trees(model, prompts, 24, "eager", 3, **kw)
    same_rows(eager, compiled)
    assert sum(poisoned) > 100 and sum(moved) > 10
    monkeypatch.setattr(StaticEngine, "compact", lambda self, places, base, keep: None)
    in_place = compiled_trees(model, prompts, 24, "eager", 3, **kw)
    assert [r.tokens for r in in_place] != [r.tokens for r in eager]


@pytest.mark.slow
@pytest.mark.skipif(c_compiler()[0] is None, reason="no C compiler")
def test_inductor_trees_equal_eager() -> None:
    """Inductor runs the trees of a BTree draft with a LoRA tail: 2 rows at once, 4 prompts
    (rows replaced), greedy and sampled, equal the eager trees field for field."""
    model = make_model("btree", 4, 2, k=1)
    prompts = chain_prompts(5, (3, 40, 17, 70))
    for greedy in (True, False):
        kw = {"greedy": greedy, "stop_ids": ()}
        eager = eager_trees(model, prompts, 24, 2, **kw)
        with no_fallback():
            compiled = compiled_trees(model, prompts, 24, "inductor", 2, **kw)
        same_rows(eager, compiled)
    assert graphs() == 4 and counters["inductor"] and not counters["graph_break"]
