"""EvaByte on the static, compiled decode engine (``compile=`` with an EvaByte target,
``mtpc.decoding.static_eva``): every row equals the eager EvaByte path field for field, the
step is one graph that does not recompile for new prompt lengths, and no slot or RFA a query
must not see is read.

Needs EvaByte's real remote code (``MTPC_EVABYTE_CODE``, as tests/test_evabyte_batch.py):
a tiny random checkpoint of it, EVA window 16 and chunks of 4, float32, the torch attention
path; prompts of 1..40 bytes and 40 new ones cross window boundaries inside prefill chunks
(32 ids), verify passes and draft-tail passes. Dynamo's ``eager`` and ``aot_eager`` backends
trace the same one graph as inductor; inductor and the triton path (its CPU interpreter) are
slow tests.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import mtpc
from mtpc.decoding import static
from mtpc.decoding.settings import c_compiler
from mtpc.decoding.static import StaticLayout
from mtpc.decoding.static_eva import EvaStaticEngine
from mtpc.model import MTPCModel
from tests.helpers import (
    evabyte_checkpoint,
    needs_evabyte_code,
    run_under_triton_interpreter,
)
from tests.test_static_decode import no_fallback

pytestmark = [needs_evabyte_code, pytest.mark.usefixtures("one_thread")]

STOPS = (5, 7)
W, C = 16, 4
FIELDS = ("tokens", "accepted", "emitted", "drafted", "offsets", "trunk_passes", "stopped")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return evabyte_checkpoint(tmp_path_factory.mktemp("eva"), window_size=W, chunk_size=C)


MODELS: dict[tuple[str, int], MTPCModel] = {}


def load(folder: Path, kind: str | None, lora: int = 0) -> MTPCModel:
    """The tiny EvaByte alone (``kind`` None) or with a draft of n = 4 (rank 2; ff: 1) and a
    LoRA tail of ``lora`` layers (random, so the draft tail differs from the verifier's)."""
    from mtpc.backbones import load_backbone

    key = (kind or "", lora)
    if key not in MODELS:
        backbone = load_backbone(
            "evabyte", path=str(folder), dtype="float32", device="cpu", attention_impl="torch"
        )
        if kind is None:
            MODELS[key] = MTPCModel.target_only(backbone)
        else:
            rank = 1 if kind == "ff" else 2
            MODELS[key] = MTPCModel.from_backbone(backbone, kind, 4, rank, lora_layers=lora)
            if lora:
                with torch.no_grad():
                    for p in MODELS[key].backbone.lora.parameters():
                        p.normal_(0, 0.05)
    return MODELS[key]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and counts only its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    for model in MODELS.values():
        static.drop_engines(model)
    yield
    torch._dynamo.reset()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Of 16, 32 and 15 bytes (a full window, two, one short), then of random lengths 1..40."""
    rng = random.Random(seed)
    lengths = [16, 32, 15] + [rng.randint(1, 40) for _ in range(count - 3)]
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def both(model: MTPCModel, items: list[list[int]], new: int, backend: str, **kw: Any) -> Any:
    """The eager EvaByte path's and the compiled engine's results of the same call."""
    kw = {"seed": list(range(len(items))), "stop_ids": STOPS, **kw}
    eager = mtpc.generate(model, items, new, **kw)
    with no_fallback():
        compiled = mtpc.generate(model, items, new, compile=backend, **kw)
    return eager, compiled


def same_rows(eager: list[Any], compiled: list[Any]) -> None:
    for field in FIELDS:
        assert [getattr(r, field) for r in compiled] == [getattr(r, field) for r in eager], field
    assert {r.engine for r in compiled} == {"compiled"}


CASES = [  # (draft kind or None: autoregressive, LoRA layers, B, graphs at that B)
    (None, 0, 1, 2), (None, 0, 8, 2), ("ff", 0, 1, 3), ("ff", 0, 8, 3), ("cp", 1, 8, 5),
    ("btree", 1, 1, 5), ("btree", 1, 8, 5),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "lora", "size", "count"), CASES)
def test_compiled_rows_equal_the_eager_evabyte_path(
    folder: Path, kind: str | None, lora: int, size: int, count: int
) -> None:
    """9 prompts (at B = 8 a finished row's place goes to the 9th), 40 new bytes, stop ids:
    greedy and sampled (each row its own seed), every field of every row equals the eager
    EvaByte path (``Stream`` at B = 1, the uncompiled engine above); the step is one graph per pass
    width (autoregressive: the decode step, the prefill chunk; a chain: the verify pass of
    n = 4, of 1 (a window's last position: ``one_pass_span``), the prefill chunk; with a LoRA
    tail also its pass of n + 1 and its chunk) and nothing breaks it."""
    model = load(folder, kind, lora)
    items = prompts(9)
    method = {"method": "autoregressive"} if kind is None else {}
    backend = "aot_eager" if size == 1 else "eager"  # aot_eager: the decomposed graph too
    sampled = {}
    for greedy in (True, False):
        eager, compiled = both(model, items, 40, backend, greedy=greedy, batch_size=size,
                               **method)  # fmt: skip
        same_rows(eager, compiled)
        sampled[greedy] = [r.tokens for r in compiled]
        if kind is not None:
            assert any(s < 4 for r in compiled for s in r.accepted)  # rejections rewound
    assert sampled[True] != sampled[False]
    # at most one graph per width (T = 1 only when every row of a pass sits at a window's end)
    assert 2 <= graphs() <= count and not counters["graph_break"]


@pytest.mark.parametrize("policy", ["recompute", "drop"])
def test_other_policies_equal_the_eager_path(folder: Path, policy: str) -> None:
    """``recompute`` (its extra one-id pass) and ``drop``, B = 3 with rows replaced."""
    model = load(folder, "btree", 1)
    eager, compiled = both(model, prompts(5, seed=1), 30, "eager", policy=policy, batch_size=3)
    same_rows(eager, compiled)


@pytest.mark.parametrize(("kind", "lora", "size"), [("btree", 1, 8), ("cp", 0, 1)])
def test_token_trees_equal_the_eager_evabyte_path(
    folder: Path, kind: str, lora: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token trees of 8 nodes (a draft started from the target's unembeddings, so paths are
    accepted), greedy and sampled: every row equals the eager EvaByte trees (``Stream`` at
    B = 1, the uncompiled engine above) field for field, and accepted paths off the pass's prefix were
    compacted in the ring. The compaction's RFA refresh matters: without it (the tree pass's
    summaries of its nodes in pass order left in the RFA slots) the tokens change."""
    from mtpc.backbones import load_backbone
    from mtpc.decoding import static_eva

    backbone = load_backbone(
        "evabyte", path=str(folder), dtype="float32", device="cpu", attention_impl="torch"
    )
    model = MTPCModel.from_backbone(backbone, kind, 4, 2, lora_layers=lora)
    torch.manual_seed(1)
    unembedding = backbone.hf_model.get_output_embeddings().weight.detach()[: backbone.vocab_size]
    model.head.from_pretrained_unembeddings(unembedding.float(), noise_std=0.3)
    with torch.no_grad():
        for p in model.head.parameters():
            if p is not model.head.unembedding:
                p.normal_(0, 0.3)
        for p in model.backbone.lora.parameters() if lora else ():
            p.normal_(0, 0.05)
    original, moved = static_eva.EvaStaticEngine.compact, []

    def compact(self: Any, places: Any, base: Any, keep: Any) -> None:
        moved.append(int((keep != torch.arange(keep.shape[1])).any(1).sum()))
        original(self, places, base, keep)

    monkeypatch.setattr(static_eva.EvaStaticEngine, "compact", compact)
    items, kw = prompts(8, seed=1), {"tree_budget": 8, "batch_size": size}
    tokens = {}
    for greedy in (False, True):
        eager, compiled = both(model, items, 40, "eager", greedy=greedy, **kw)
        same_rows(eager, compiled)
        tokens[greedy] = [r.tokens for r in eager]
    assert sum(moved) >= 2 and tokens[True] != tokens[False]
    monkeypatch.setattr(static_eva, "refresh_rfas", lambda *args: None)
    seeds = list(range(len(items)))
    stale = mtpc.generate(model, items, 40, compile="eager", seed=seeds, stop_ids=STOPS, **kw)
    assert [r.tokens for r in stale] != tokens[True]


def test_no_recompilation_for_new_prompt_lengths(folder: Path) -> None:
    """After a warm-up (B = 1 and B = 5), five prompts of other lengths (1 to 4 prefill
    chunks, windows crossed at other offsets) decode their chains with the graphs compiled
    already, alone and five at once."""
    model = load(folder, "btree", 1)
    kw = {"stop_ids": (), "compile": "eager"}
    rng = random.Random(3)
    warm = [[rng.randrange(3, 300) for _ in range(15)] for _ in range(5)]  # 1 before a window end:
    mtpc.generate(model, warm[0], 12, **kw)  # the first cycle verifies T = 1, the next T = 4
    mtpc.generate(model, warm, 12, batch_size=5, **kw)
    # (verify T = 4 and 1, chunk; the tail's 5 and chunk) x 2 B
    assert graphs() == 10 and not counters["graph_break"]
    items = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 31, 33, 64, 100)]
    with torch._dynamo.config.patch(error_on_recompile=True), no_fallback():
        alone = [mtpc.generate(model, p, 20, **kw) for p in items]
        batch = mtpc.generate(model, items, 20, batch_size=5, **kw)
    assert graphs() == 10
    assert {r.engine for r in [*alone, *batch]} == {"compiled"}
    assert [r.tokens for r in alone] == [r.tokens for r in batch]


class BlindEngine(EvaStaticEngine):
    """A deliberately broken mask: every ring slot and every RFA visible."""

    def _prepare(self, cache, valid, lengths, real, offsets, inner):  # type: ignore[no-untyped-def]
        positions, seen = super()._prepare(cache, valid, lengths, real, offsets, inner)
        seen[..., : cache.rfas + cache.ring] = True
        return positions, seen


class LateEngine(EvaStaticEngine):
    """A deliberately broken mask: a query also sees the ring slots of its row's positions
    before its window (of the window before it, as if no compression happened)."""

    def _prepare(self, cache, valid, lengths, real, offsets, inner):  # type: ignore[no-untyped-def]
        positions, seen = super()._prepare(cache, valid, lengths, real, offsets, inner)
        f, ring = cache.rfas, cache.ring
        top = lengths[:, None]
        held = top - 1 - (top - 1 - torch.arange(ring)) % ring  # (B, R)
        earlier = (held >= 0) & (held >= top - W) & (held < top)  # (B, R)
        seen[..., f : f + ring] |= earlier[:, None, :]
        return positions, seen


def poisoned_outputs(
    model: MTPCModel, engine_type: type, poison: bool, chunk: int = 32
) -> torch.Tensor:
    """Rows of 5, 37 and 23 bytes (place 3 empty) in an engine, then one pass of 32 ids of
    row 0 and 9 of row 2 (crossing window boundaries; row 1 sits out): the real ids' logits.
    ``poison``: first, huge keys and values in every slot no query of the pass may read: the
    ring slots of positions before each row's window or past its length, the RFA slots of
    chunks not complete before the pass (a complete chunk of the row's window is read by the
    queries past the window's end), the scratch, the empty place."""
    engine = engine_type(model, 4, 256, backend="eager", chunk=chunk)
    layout = StaticLayout(engine)
    rng = random.Random(5)
    rows = [object() for _ in range(3)]
    lengths = (5, 37, 23)
    layout.admit(rows, [torch.tensor([rng.randrange(3, 300) for _ in range(n)]) for n in lengths])
    cache = engine.cache
    f, ring = cache.rfas, cache.ring
    if poison:
        now = engine.lengths[:, None]  # (B, 1)
        start = now - now % W  # (B, 1) each row's window start
        held = now - 1 - (now - 1 - torch.arange(ring)) % ring  # (B, R)
        bad_ring = (held < start) | (held >= now)  # (B, R)
        bad_rfas = (torch.arange(f) + 1) * C > now  # (B, F) chunks not complete before
        scratch = torch.ones(4, engine.slots - f - ring, dtype=torch.bool)
        bad = torch.cat([bad_rfas, bad_ring, scratch], 1)  # (B, S)
        bad[3] = True
        for buffer in (*cache.keys, *cache.values):
            buffer.masked_fill_(bad[:, None, :, None], 1e6)
    real = torch.zeros(4, 32, dtype=torch.bool)
    real[0], real[2, :9] = True, True
    ids = torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(6))
    offsets = torch.arange(32).expand(4, 32)
    inner = (torch.ones(32, 32, dtype=torch.bool).tril() & real[:, None, :]) | torch.eye(
        32, dtype=torch.bool
    )
    with torch.no_grad():
        return engine.step(ids, real, offsets, inner)[1][real]  # the real ids' logits


@pytest.mark.parametrize("chunk", [32, 40])
def test_no_slot_or_rfa_a_query_must_not_see_is_read(folder: Path, chunk: int) -> None:
    """Huge keys and values in every slot and RFA no query of a pass may read (other rows',
    stale ring slots, incomplete chunks' RFAs, the scratch) change no output; the same poison
    changes them when the mask shows every slot, or a window's earlier positions (a mask
    this test would not catch would pass the broken engines too). Prefill chunks of 32 and
    40: rings of 48 and 56 slots (W + the chunk; 56 is not a multiple of W)."""
    model = load(folder, None)
    clean = poisoned_outputs(model, EvaStaticEngine, poison=False, chunk=chunk)
    assert bool(clean.isfinite().all())
    if chunk != 32:  # the same outputs as the ring of 48 (to float rounding)
        torch.testing.assert_close(clean, poisoned_outputs(model, EvaStaticEngine, False))
    assert torch.equal(poisoned_outputs(model, EvaStaticEngine, True, chunk), clean)
    for broken in (BlindEngine, LateEngine):
        got = poisoned_outputs(model, broken, poison=True, chunk=chunk)
        assert not torch.allclose(got, clean, atol=1e-2), broken.__name__


def test_rewound_slots_are_never_read(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After every keep, huge keys and values go into every ring slot past each row's
    rewound length (the rejected drafts', trunk and draft tail): the rows still equal the
    eager path; the same poison without the rewind (a keep that keeps everything) changes
    them."""
    model = load(folder, "btree", 1)
    items = prompts(5, seed=4)
    kw = {"batch_size": 3, "stop_ids": (), "seed": list(range(5)), "policy": "recompute"}
    eager = mtpc.generate(model, items, 30, **kw)
    original = StaticLayout.keep

    def poison(layout: StaticLayout) -> None:
        engine = layout.engine
        for cache, lengths in ((engine.cache, engine.lengths),
                               (engine.draft_cache, engine.draft_lengths)):  # fmt: skip
            f, ring = cache.rfas, cache.ring
            now = lengths[:, None]
            held = now - 1 - (now - 1 - torch.arange(ring)) % ring  # (B, R)
            stale = torch.zeros(lengths.shape[0], engine.slots, dtype=torch.bool)
            stale[:, f : f + ring] = held < now - now % W  # before the row's window: free
            stale[:, f : f + ring] |= (torch.arange(ring) - now) % ring < engine.window + 1
            for buffer in (*cache.keys, *cache.values):
                buffer.masked_fill_(stale[:, None, :, None], 1e6)

    def keep(self: StaticLayout, rows: Any, keeps: Any) -> None:
        original(self, rows, keeps)
        poison(self)

    monkeypatch.setattr(StaticLayout, "keep", keep)
    with no_fallback():
        compiled = mtpc.generate(model, items, 30, compile="eager", **kw)
    same_rows(eager, compiled)
    monkeypatch.setattr(StaticLayout, "keep", lambda self, rows, keeps: poison(self))
    kept_all = mtpc.generate(model, items, 30, compile="eager", **kw)
    assert [r.tokens for r in kept_all] != [r.tokens for r in eager]


@pytest.mark.slow
@pytest.mark.skipif(c_compiler()[0] is None, reason="no C compiler")
def test_inductor_rows_equal_the_eager_path(folder: Path) -> None:
    """Inductor (``compile=True``): autoregressive and a BTree chain with a LoRA tail, B = 2
    with rows replaced, greedy and sampled."""
    items = prompts(4, seed=7)
    for kind, lora, method in ((None, 0, "autoregressive"), ("btree", 1, "speculative")):
        model = load(folder, kind, lora)
        for greedy in (True, False):
            eager, compiled = both(model, items, 30, True, greedy=greedy, batch_size=2,  # type: ignore[arg-type]
                                   method=method)  # fmt: skip
            same_rows(eager, compiled)
    assert counters["inductor"] and not counters["graph_break"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_path_compiled_equals_eager_under_the_interpreter(tmp_path: Path) -> None:
    """EvaByte's triton path (its prefill kernels and window compression in the eager path,
    triton's CPU interpreter, window 128 as the kernels' blocks need; the static step runs
    its torch attention with SDPA, as the triton path's decoding passes do): compiled ==
    eager, B = 2 of 3 rows, autoregressive and the chain."""
    run_under_triton_interpreter(tmp_path, TRITON_SCRIPT)


TRITON_SCRIPT = """
import random
import torch
import mtpc
from mtpc.backbones import load_backbone
from mtpc.model import MTPCModel
backbone = load_backbone(
    "evabyte", path={path!r}, dtype="float32", device="cpu", attention_impl="triton"
)
assert backbone.use_triton
model = MTPCModel.from_backbone(backbone, "cp", 4, 2, lora_layers=1)
with torch.no_grad():
    for p in model.backbone.lora.parameters():
        p.normal_(0, 0.05)
rng = random.Random(0)
items = [[rng.randrange(3, 300) for _ in range(rng.randint(100, 140))] for _ in range(3)]
fields = lambda r: (r.tokens, r.accepted, r.trunk_passes, r.engine)
for kw in ({{"method": "autoregressive"}}, {{}}, {{"greedy": False}}):
    kw = dict(kw, seed=[0, 1, 2], stop_ids=(5, 7), batch_size=2)
    want = [fields(r)[:3] for r in mtpc.generate(model, items, 40, **kw)]
    got = [fields(r) for r in mtpc.generate(model, items, 40, compile="aot_eager", **kw)]
    print(kw, [len(w[0]) for w in want], [g[:3] for g in got] == want)
    assert [g[:3] for g in got] == want and {{g[3] for g in got}} == {{"compiled"}}, kw
print("equal")
"""
