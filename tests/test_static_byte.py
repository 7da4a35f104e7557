"""The byte Llama on the static engine (``Llama3ByteBackbone``, its expansion embedding reading
each id's last ``maxlen`` ids): the engine keeps the rows' ids by slot (``slot_ids``, written
by the step, compacted with a tree's keep), and the step walks the expansion trie on each new
id's history in the graph (``StaticEngine._windows``, ``ExpansionLookup.walk``). Compiled
rows equal the eager path's (the fake byte Llama of ``tests.fakes``): autoregressive, the
chain and token trees, B = 1 and B = 3 with rows replaced; a step that drops the rows' past
ids from the histories changes the tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

import mtpc
from mtpc.decoding.static import StaticEngine
from mtpc.model import MTPCModel
from tests.fakes import fake_llama3_byte
from tests.test_static_decode import graphs, no_fallback

# _fresh_dynamo: the autouse fixture (each test compiles from scratch, counts its own graphs)
from tests.test_static_tree import _fresh_dynamo, compiled_trees, eager_trees  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def byte_model(k: int = 1) -> MTPCModel:
    """A CP draft (n = 4, r = 2) with a LoRA tail of k layers on the fake byte Llama."""
    torch.manual_seed(0)
    model = MTPCModel.from_hf(fake_llama3_byte(2, vocab_size=40), kind="cp", window=4, rank=2,
                              lora_layers=k)  # fmt: skip
    if k:
        with torch.no_grad():
            for p in model.backbone.lora.parameters():
                p.normal_(0, 0.05)
    return model.eval()


def byte_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(40) for _ in range(n)] for n in (3, 9, 40, 17, 5)]


@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_compiled_byte_llama_equals_eager(size: int) -> None:
    """Autoregressive and the chain (``condition`` greedy, ``recompute`` sampled): the rows
    equal the eager path's (tokens, accepted drafts), one graph per shape, no graph break."""
    model, prompts = byte_model(), byte_prompts()
    seeds = list(range(len(prompts)))
    for kw in ({"method": "autoregressive"}, {"policy": "condition"},
               {"policy": "recompute", "greedy": False}):  # fmt: skip
        kw = {"batch_size": size, "stop_ids": (), "seed": seeds, **kw}
        eager = mtpc.generate(model, prompts, 16, **kw)  # type: ignore[arg-type]
        with no_fallback():
            compiled = mtpc.generate(model, prompts, 16, compile="eager", **kw)  # type: ignore[arg-type]
        assert [r.tokens for r in compiled] == [r.tokens for r in eager]
        assert [r.accepted for r in compiled] == [r.accepted for r in eager]
        assert {r.engine for r in compiled} == {"compiled"}
    assert not counters["graph_break"]
    # the chunk, T = 1 (AR, recompute), the chain's T = 4; the tail's 5 and chunk
    assert graphs() == 5


@pytest.mark.slow  # trees on the engine stay in the quick set (test_static_tree.py)
@pytest.mark.parametrize("size", [1, 3])
def test_compiled_byte_llama_trees_equal_eager(size: int) -> None:
    """Token trees on the byte Llama (each node's expansion after its own root path): the
    rows equal the eager trees', greedy and sampled."""
    model, prompts = byte_model(), byte_prompts(1)
    for greedy in (True, False):
        kw = {"greedy": greedy, "stop_ids": ()}
        eager = eager_trees(model, prompts, 16, size, **kw)
        with no_fallback():
            compiled = compiled_trees(model, prompts, 16, "eager", size, **kw)
        for field in ("tokens", "accepted", "nodes"):
            assert [getattr(r, field) for r in compiled] == [getattr(r, field) for r in eager]
        assert any(s for r in compiled for s in r.accepted)  # paths were kept
    assert not counters["graph_break"]


def test_a_history_without_the_past_changes_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expansion reads the rows' past ids: a step whose histories hold only the pass's
    new ids decodes other tokens (the embedding's history is not decorative)."""
    model, prompts = byte_model(0), byte_prompts(2)
    kw = {"method": "autoregressive", "batch_size": 3, "stop_ids": ()}
    eager = mtpc.generate(model, prompts, 16, **kw)  # type: ignore[arg-type]
    original = StaticEngine._windows

    def no_past(self: StaticEngine, ids, offsets, inner):  # type: ignore[no-untyped-def]
        windows = original(self, ids, offsets, inner)
        depth = offsets[:, :, None] - torch.arange(windows.shape[2])  # (B, T, m)
        return torch.where(depth >= 0, windows, 0)

    monkeypatch.setattr(StaticEngine, "_windows", no_past)
    cut = mtpc.generate(model, prompts, 16, compile="eager", **kw)  # type: ignore[arg-type]
    assert [r.tokens for r in cut] != [r.tokens for r in eager]
