"""Compiled decoding (``mtpc.generate(..., compile=...)``, ``mtpc.decoding.static``): the
static engine's tokens and logits equal the eager path's, its step is one graph that does not
recompile for new prompt lengths, the slots no row holds are never read, and every setting it
cannot run is refused in one line before any decoding.

Dynamo's ``eager`` and ``aot_eager`` backends trace the same one graph as inductor (a graph
break or a recompilation shows the same); only the slow test runs inductor. A ``compile=``
that quietly ran the eager layouts fails here: the results' ``engine`` and dynamo's graph
count are asserted.
"""

from __future__ import annotations

import contextlib
import gc
import random
import shutil
import warnings
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

import mtpc
from mtpc.backbones.llama import LlamaBackbone
from mtpc.decoding import static, static_step
from mtpc.decoding.layout import Stream
from mtpc.decoding.settings import c_compiler
from mtpc.decoding.static import StaticEngine, StaticLayout
from mtpc.model import MTPCModel
from tests.fakes import fake_evabyte, fake_llama3_byte, make_model, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (3, 9, 40, 17, 70, 5, 33, 1)  # 8 prompts of different lengths (70: 3 prefill chunks)


@pytest.fixture(scope="module")
def tiny() -> MTPCModel:
    """The bundled tiny target (float32) alone, for autoregressive decoding."""
    from mtpc.backbones import load_backbone

    return MTPCModel.target_only(load_backbone("tiny"))


@pytest.fixture(autouse=True)
def _fresh_dynamo(tiny: MTPCModel) -> Iterator[None]:
    """Each test compiles from scratch, counts only its own graphs and its own engines."""
    torch._dynamo.reset()
    counters.clear()
    static.drop_engines(tiny)
    yield
    torch._dynamo.reset()
    static.drop_engines(tiny)


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(64, 320) for _ in range(n)] for n in lengths]


def graphs() -> int:
    """Graphs dynamo compiled since the last reset."""
    return int(counters["stats"]["unique_graphs"])


def both(model: MTPCModel, prompts: list[list[int]], new: int, backend: str, **kw: object):
    """The eager and the compiled results of the same call."""
    kw = {"method": "autoregressive", "seed": list(range(len(prompts))), **kw}
    eager = mtpc.generate(model, prompts, new, **kw)  # type: ignore[arg-type]
    with no_fallback():
        compiled = mtpc.generate(model, prompts, new, compile=backend, **kw)  # type: ignore[arg-type]
    return eager, compiled


@contextlib.contextmanager
def no_fallback() -> Iterator[None]:
    """Fails when the compiled step fell back to eager inside the block (its warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        yield
    fallbacks = [str(w.message) for w in caught if "decode step failed" in str(w.message)]
    assert not fallbacks, fallbacks


@pytest.mark.parametrize(
    "size", [pytest.param(1, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow), 3]
)
def test_compiled_tokens_equal_eager(tiny: MTPCModel, size: int) -> None:
    """8 prompts of different lengths: B = 1 (one prompt at a time in one engine), all 8 at
    once, and 3 at once (finished rows' places taken by waiting prompts): greedy and sampled
    (each row its own seed) rows equal the eager path token for token."""
    prompts = prompts_of(LENGTHS)
    backend = "aot_eager" if size == 1 else "eager"  # aot_eager: the decomposed graph too
    tokens = {}
    for greedy in (True, False):
        eager, compiled = both(tiny, prompts, 32, backend, greedy=greedy, batch_size=size,
                               suppress_eos=True)  # fmt: skip
        tokens[greedy] = [r.tokens for r in compiled]
        assert tokens[greedy] == [r.tokens for r in eager]
        assert all(len(r.tokens) == 32 for r in compiled)
        assert {r.engine for r in compiled} == {"compiled"}
        assert {r.engine for r in eager} == {"eager"}
        assert [r.trunk_passes for r in compiled] == [r.trunk_passes for r in eager]
    assert tokens[True] != tokens[False]  # the draws are not argmaxes: the seeds were used
    assert graphs() == 2  # the decode step (T = 1) and the prefill chunk, at this B
    assert not counters["graph_break"]


def test_rows_stop_at_their_own_ends(tiny: MTPCModel) -> None:
    """With the codec's stop ids, rows end at different lengths and leave; the rest go on."""
    prompts = prompts_of(LENGTHS, seed=1)
    eager, compiled = both(tiny, prompts, 48, "eager", greedy=False, batch_size=3)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    assert len({len(r.tokens) for r in compiled}) > 2 and any(r.stopped for r in compiled)


def test_float64_lora_target_with_grouped_heads() -> None:
    """A float64 2-layer Llama with 2 key-value heads for 4 queries and a LoRA tail (k = 1,
    off for the target): every row equals the eager path."""
    model = make_model("btree", 4, 2, k=1)
    prompts = [[random.Random(i).randrange(48) for _ in range(n)] for i, n in enumerate(LENGTHS)]
    eager, compiled = both(model, prompts, 24, "eager", batch_size=4, stop_ids=())
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]


def _stream_logits(model: MTPCModel, prompt: list[int], new: list[int]) -> torch.Tensor:
    """The eager path's logits ``(1 + len(new), V)``: after the prompt, then after each id."""
    stream = Stream(model)
    out = [stream.admit([None], [torch.tensor(prompt)])[1][0]]  # (1, V)
    out += [stream.target([None], [torch.tensor([t])], [None])[1][0] for t in new]
    return torch.cat(out)


@torch.no_grad()
def test_static_logits_equal_the_eager_layers(tiny: MTPCModel) -> None:
    """Rows at different lengths in one engine: each row's logits after its prompt and
    after each of 12 more ids equal the eager stream's to 1e-5 (float32)."""
    prompts = prompts_of((5, 40, 17))
    rows = [object() for _ in prompts]
    layout = StaticLayout(StaticEngine(tiny, 3, 256, backend="eager"))
    logits = [[last] for last in layout.admit(rows, [torch.tensor(p) for p in prompts])[1]]
    follow = prompts_of((12, 12, 12), seed=2)
    for i in range(12):
        out = layout.target(rows, [torch.tensor([f[i]]) for f in follow], [None] * 3)[1]
        for got, last in zip(logits, out, strict=True):
            got.append(last)
    for p, f, got in zip(prompts, follow, logits, strict=True):
        torch.testing.assert_close(torch.cat(got), _stream_logits(tiny, p, f), rtol=0, atol=1e-5)
    assert layout.engine.engine == "compiled"


def test_no_recompilation_for_new_prompt_lengths(tiny: MTPCModel) -> None:
    """After a warm-up, five prompts of other lengths (one call each at B = 1, and all five
    at B = 5 after its own warm-up) decode with the graphs compiled already."""
    kw = {"method": "autoregressive", "suppress_eos": True}
    mtpc.generate(tiny, [7, 8, 9], 4, compile="eager", **kw)  # type: ignore[arg-type]
    mtpc.generate(tiny, prompts_of((2,) * 5), 4, compile="eager", batch_size=5, **kw)  # type: ignore[arg-type]
    assert graphs() == 4 and not counters["graph_break"]  # (T = 1, T = chunk) x (B = 1, 5)
    prompts = prompts_of((1, 31, 33, 64, 100), seed=3)  # 1 to 4 prefill chunks
    with torch._dynamo.config.patch(error_on_recompile=True), no_fallback():
        # (a recompilation raises: the step falls back to eager with a warning)
        alone = [mtpc.generate(tiny, p, 20, compile="eager", **kw) for p in prompts]  # type: ignore[arg-type]
        batch = mtpc.generate(tiny, prompts, 20, compile="eager", batch_size=5, **kw)  # type: ignore[arg-type]
    assert graphs() == 4
    assert {r.engine for r in [*alone, *batch]} == {"compiled"}
    assert [r.tokens for r in alone] == [r.tokens for r in batch]


def test_engines_are_reused_and_go_with_their_model() -> None:
    """The next call of the same shape reuses the engine (buffers and graph); a model no
    longer referenced is freed with its engines."""
    model = make_model("btree", 4, 2, k=0)
    kw = {"method": "autoregressive", "compile": "eager", "stop_ids": ()}
    mtpc.generate(model, [1, 2, 3], 4, **kw)  # type: ignore[arg-type]
    (engine,) = vars(model)[static.ENGINES_ATTRIBUTE].values()
    mtpc.generate(model, [4, 5, 6, 7, 8], 6, **kw)  # type: ignore[arg-type]
    assert list(vars(model)[static.ENGINES_ATTRIBUTE].values()) == [engine]
    alive = weakref.ref(model)
    del model, engine
    gc.collect()
    assert alive() is None


@torch.no_grad()
def test_slots_no_row_holds_are_never_read(tiny: MTPCModel) -> None:
    """Huge keys and values in every slot no row holds (beyond a row's length, a left row's
    place, the scratch) change no output of a step, prefill chunk or decode step; the same
    values in the rows' own slots (what an ignored mask would read) change them all."""
    engine = StaticEngine(tiny, 4, 256, backend="eager")
    layout = StaticLayout(engine)
    rows = [object() for _ in range(3)]  # place 3 holds no row
    layout.admit(rows, [torch.tensor(p) for p in prompts_of((5, 40, 17))])
    ids = torch.tensor([[70] * 32, [80] * 32, [90] * 32, [100] * 32])  # (B, 32)
    real = torch.zeros(4, 32, dtype=torch.bool)
    real[0], real[1, :1] = True, True  # a full chunk, one id, and two idle rows
    offsets = torch.arange(32).expand(4, 32)
    inner = (torch.ones(32, 32, dtype=torch.bool).tril() & real[:, None, :]) | torch.eye(
        32, dtype=torch.bool
    )
    state = [t.clone() for t in (*engine.cache.keys, *engine.cache.values)]
    valid, lengths = engine.valid.clone(), engine.lengths.clone()

    def step(fill: torch.Tensor | None) -> torch.Tensor:
        for buffer, saved in zip((*engine.cache.keys, *engine.cache.values), state, strict=True):
            buffer.copy_(saved)
            if fill is not None:
                buffer.masked_fill_(fill[:, None, :, None], 1e6)  # (B, 1, S, 1)
        engine.valid.copy_(valid)
        engine.lengths.copy_(lengths)
        return engine.step(ids, real, offsets, inner)[1][real]  # the real ids' logits

    clean = step(None)
    assert torch.equal(step(~valid), clean) and bool(clean.isfinite().all())
    held = valid.clone()
    held[:, : engine.capacity] &= torch.rand(held.shape[0], engine.capacity) < 0.3
    assert not torch.allclose(step(held), clean, atol=1e-2)  # reading held slots shows
    for row in range(3):  # an idle row (3) and a row's new slots do not leak either
        assert bool(valid[row, : int(lengths[row])].all())
    assert not bool(valid[3].any())


def test_a_compile_failure_falls_back_to_eager_with_a_warning(
    tiny: MTPCModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that cannot compile: a warning naming why, the same caches run eagerly, the
    same tokens, ``engine`` = ``static``."""

    def broken(step, backend, device):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("no graph today")

        return run

    monkeypatch.setattr(static_step, "compile_step", broken)
    prompts = prompts_of((4, 30, 12))
    eager = mtpc.generate(tiny, prompts, 16, method="autoregressive", batch_size=2)
    with pytest.warns(RuntimeWarning, match="RuntimeError: no graph today"):
        out = mtpc.generate(tiny, prompts, 16, method="autoregressive", batch_size=2,
                            compile="eager")  # fmt: skip
    assert [r.tokens for r in out] == [r.tokens for r in eager]
    assert {r.engine for r in out} == {"static"}


def _no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("decoding started before the refusal")

    monkeypatch.setattr(static, "decode_static", refuse)
    monkeypatch.setattr("mtpc.decoding.loop.decode", refuse)


def _attention(hf: torch.nn.Module, impl: str) -> torch.nn.Module:
    hf.config._attn_implementation = impl  # type: ignore[union-attr]
    return hf


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (lambda: LlamaBackbone(fake_llama3_byte(2)), r"^compile=True does not support "
         r"LlamaBackbone with remote-code layers; supported: LlamaBackbone with "
         r"transformers' own Llama layers \(the tiny target, HF Llama checkpoints\), "
         r"Llama3ByteBackbone or EvaByteBackbone, and attention sdpa or eager$"),
        (lambda: _attention(tiny_llama(2), "flex_attention"), r"^compile=True does not "
         r"support attention 'flex_attention'; supported: .* and attention sdpa or eager$"),
    ],
)  # fmt: skip
def test_unsupported_backbones_are_refused(target, message: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _no_decoding(monkeypatch)
    model = MTPCModel.target_only(target())
    with pytest.raises(ValueError, match=message) as err:
        mtpc.generate(model, [5, 6, 7], 4, method="autoregressive", compile=True, stop_ids=())
    assert "\n" not in str(err.value)


def test_evabyte_is_not_refused() -> None:
    """EvaByte has its own static engine (``mtpc.decoding.static_eva``; its decoding is
    tested on EvaByte's real code in tests/test_evabyte_static.py)."""
    assert static.supports_compile(MTPCModel.target_only(fake_evabyte(2))) is None
    model = MTPCModel.target_only(fake_evabyte(2))
    assert static.engine_class(model).__name__ == "EvaStaticEngine"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"compile": "max", "method": "autoregressive"}, r"^compile='max' is not allowed; "
         r"allowed: True, False, 'inductor', 'aot_eager', 'eager'$"),
    ],
)  # fmt: skip
def test_bad_compile_settings_are_refused(tiny, kw, message, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _no_decoding(monkeypatch)
    with pytest.raises(ValueError, match=message):
        mtpc.generate(tiny, [5, 6, 7], 4, **kw)


def test_inductor_without_a_c_compiler_is_refused(tiny: MTPCModel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _no_decoding(monkeypatch)
    looked: list[str] = []
    monkeypatch.setattr(shutil, "which", lambda name: looked.append(name))
    monkeypatch.setenv("CC", "clang-99")
    message = (
        r"^compile=True needs a C compiler for torch.compile's inductor backend; looked for "
        r"\$CC=clang-99, cc, gcc, g\+\+ on the PATH and found none; allowed: compile=False, "
        r"or compile='aot_eager' \(no C compiler: no speed-up\)$"
    )
    with pytest.raises(ValueError, match=message):
        mtpc.generate(tiny, [5, 6, 7], 4, method="autoregressive", compile=True)
    assert looked == ["clang-99", "cc", "gcc", "g++"]
    monkeypatch.delenv("CC")
    with pytest.raises(ValueError, match=r"looked for cc, gcc, g\+\+ on the PATH"):
        mtpc.generate(tiny, [5, 6, 7], 4, method="autoregressive", compile="inductor")
    monkeypatch.undo()  # aot_eager needs no C compiler: it decodes
    out = mtpc.generate(tiny, [5, 6, 7], 4, method="autoregressive", compile="aot_eager")
    assert out.engine == "compiled" and len(out.tokens) >= 1


@pytest.mark.slow
@pytest.mark.skipif(c_compiler()[0] is None, reason="no C compiler")
def test_inductor_tokens_equal_eager(tiny: MTPCModel) -> None:
    """Inductor (the default backend, compile=True): 2 rows at once, 4 prompts (rows
    replaced), greedy and sampled, equal the eager path token for token."""
    prompts = prompts_of((3, 40, 17, 70))
    for greedy in (True, False):
        eager, compiled = both(tiny, prompts, 32, "inductor", greedy=greedy, batch_size=2,
                               suppress_eos=True)  # fmt: skip
        assert [r.tokens for r in compiled] == [r.tokens for r in eager]
        assert {r.engine for r in compiled} == {"compiled"}
    assert graphs() == 2 and counters["inductor"]


# --- the speculative chain on the engine (verify T = the window, keep = a rewind) ---

CHAIN_MODES = [  # (policy, greedy): every policy, sampled where it is exact
    ("condition", True), ("condition", False), ("recompute", True), ("recompute", False),
    ("drop", True),
]  # fmt: skip


def chain_prompts(seed: int = 0, lengths: tuple[int, ...] = LENGTHS[:6]) -> list[list[int]]:
    """Prompts of the 48-id fake targets (``tests.fakes.make_model``)."""
    rng = random.Random(seed)
    return [[rng.randrange(48) for _ in range(n)] for n in lengths]


def same_rows(eager: list, compiled: list) -> None:  # type: ignore[type-arg]
    """Row by row, every per-cycle field of the eager path's results."""
    for field in ("tokens", "accepted", "emitted", "drafted", "offsets", "trunk_passes"):
        assert [getattr(r, field) for r in compiled] == [getattr(r, field) for r in eager], field
    assert {r.engine for r in compiled} == {"compiled"}
    assert {r.engine for r in eager} == {"eager"}


@pytest.mark.parametrize(
    ("kind", "k", "size"),
    [
        pytest.param("btree", 1, 1, marks=pytest.mark.slow),
        ("btree", 1, 3),
        pytest.param("ff", 0, 1, marks=pytest.mark.slow),
        pytest.param("ff", 0, 3, marks=pytest.mark.slow),
    ],
)  # B = 1 slow: the quick set keeps the batches
def test_compiled_chain_equals_eager(kind: str, k: int, size: int) -> None:
    """The speculative chain on the engine (float64 fakes, a BTree draft with a LoRA tail and
    an FF draft reading the trunk's state): every policy, greedy and sampled (each row its
    own seed), B = 1 and B = 3 with rows replaced; every row equals the eager path field for
    field (tokens, accepted drafts per cycle, passes), and the graphs are one per shape."""
    model = make_model(kind, 4, 2 if kind == "btree" else 1, k=k)
    prompts = chain_prompts()
    backend = "aot_eager" if (kind, size) == ("btree", 1) else "eager"
    sampled = {}
    for policy, greedy in CHAIN_MODES:
        kw = {"policy": policy, "greedy": greedy, "batch_size": size, "stop_ids": (),
              "seed": list(range(len(prompts)))}  # fmt: skip
        eager = mtpc.generate(model, prompts, 24, **kw)  # type: ignore[arg-type]
        with no_fallback():
            compiled = mtpc.generate(model, prompts, 24, compile=backend, **kw)  # type: ignore[arg-type]
        same_rows(eager, compiled)
        assert any(s < 3 for r in compiled for s in r.accepted)  # rejections were rewound
        sampled[greedy] = [r.tokens for r in compiled]
    assert sampled[True] != sampled[False]
    # verify T = 4 and 1 (recompute), the prefill chunk; the draft tail's 5 and chunk (k > 0)
    assert graphs() == (5 if k else 3) and not counters["graph_break"]


def test_chain_does_not_recompile_for_new_prompt_lengths() -> None:
    """After a warm-up (B = 1 and B = 5), five prompts of other lengths decode their chains
    (a LoRA tail: four graphs per batch size) with the graphs compiled already."""
    model = make_model("btree", 4, 2, k=1)
    kw = {"stop_ids": (), "compile": "eager"}
    mtpc.generate(model, chain_prompts(1, (40,)), 8, **kw)  # type: ignore[arg-type]
    mtpc.generate(model, chain_prompts(1, (40,) * 5), 8, batch_size=5, **kw)  # type: ignore[arg-type]
    assert graphs() == 8 and not counters["graph_break"]  # (chunk, T = 4) x (trunk, tail) x 2 B
    prompts = chain_prompts(3, (1, 31, 33, 64, 100))
    with torch._dynamo.config.patch(error_on_recompile=True), no_fallback():
        alone = [mtpc.generate(model, p, 20, **kw) for p in prompts]  # type: ignore[arg-type]
        batch = mtpc.generate(model, prompts, 20, batch_size=5, **kw)  # type: ignore[arg-type]
    assert graphs() == 8
    assert {r.engine for r in [*alone, *batch]} == {"compiled"}
    assert [r.tokens for r in alone] == [r.tokens for r in batch]


def poison_past_lengths(layout: StaticLayout, width: int) -> int:
    """Huge keys and values in every slot past each row's length (trunk, and cache D once it
    exists); returns how many of them the last pass of ``width`` ids per row wrote (its
    rejected positions' slots, past the rows' new lengths)."""
    engine = layout.engine
    for buffers, lengths in ((engine.cache, engine.lengths),
                             (engine.draft_cache, engine.draft_lengths)):  # fmt: skip
        if buffers is None:  # cache D starts with the first draft pass
            continue
        free = engine.slot_index[None] >= lengths[:, None]  # (B, S)
        for buffer in (*buffers.keys, *buffers.values):
            buffer.masked_fill_(free[:, None, :, None], 1e6)
    slot, passed = engine.slot_index[None], layout.base[:, None] + width
    return int(((slot >= engine.lengths[:, None]) & (slot < passed)).sum())


@pytest.mark.parametrize("policy", ["recompute", pytest.param("condition", marks=pytest.mark.slow)])
def test_rewound_slots_are_never_read(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After every keep, huge keys and values go into every slot past each row's rewound
    length (the rejected drafts', trunk and draft tail): the rows still equal the eager path.
    A keep that rewinds the lengths but leaves the rejected slots valid reads them (the
    ``recompute`` pass does, before the next window overwrites them) and changes the
    tokens, and so does a keep that rewinds nothing: this test sees a keep that does not
    rewind."""
    model = make_model("btree", 4, 2, k=1)
    prompts = chain_prompts(4)
    kw = {"policy": policy, "batch_size": 3, "stop_ids": ()}
    eager = mtpc.generate(model, prompts, 24, **kw)  # type: ignore[arg-type]
    original, poisoned = StaticLayout.keep, []

    def poison(layout: StaticLayout) -> None:
        poisoned.append(poison_past_lengths(layout, layout.engine.window))

    def keep(self: StaticLayout, rows, keeps) -> None:  # type: ignore[no-untyped-def]
        original(self, rows, keeps)
        poison(self)

    def lazy_keep(self: StaticLayout, rows, keeps) -> None:  # type: ignore[no-untyped-def]
        valid = self.engine.valid.clone()
        original(self, rows, keeps)
        self.engine.valid.copy_(valid)  # the lengths rewound, the rejected slots still held
        poison(self)

    monkeypatch.setattr(StaticLayout, "keep", keep)
    with no_fallback():
        compiled = mtpc.generate(model, prompts, 24, compile="eager", **kw)  # type: ignore[arg-type]
    same_rows(eager, compiled)
    assert sum(poisoned) > 20  # rejected drafts' slots were poisoned
    monkeypatch.setattr(StaticLayout, "keep", lazy_keep)
    lazy = mtpc.generate(model, prompts, 24, compile="eager", **kw)  # type: ignore[arg-type]
    if policy == "recompute":  # its extra pass reads the stale slots
        assert [r.tokens for r in lazy] != [r.tokens for r in eager]
    monkeypatch.setattr(StaticLayout, "keep", lambda self, rows, keeps: poison(self))
    kept_all = mtpc.generate(model, prompts, 24, compile="eager", **kw)  # type: ignore[arg-type]
    assert [r.tokens for r in kept_all] != [r.tokens for r in eager]  # no rewind at all


@pytest.mark.slow
@pytest.mark.skipif(c_compiler()[0] is None, reason="no C compiler")
def test_inductor_chain_equals_eager() -> None:
    """Inductor (compile=True) runs the chain of a BTree draft with a LoRA tail: 2 rows at
    once, 4 prompts (rows replaced), greedy and sampled, equal the eager path field for field."""
    model = make_model("btree", 4, 2, k=1)
    prompts = chain_prompts(5, (3, 40, 17, 70))
    for greedy in (True, False):
        kw = {"greedy": greedy, "batch_size": 2, "stop_ids": (), "seed": [0, 1, 2, 3]}
        eager = mtpc.generate(model, prompts, 24, **kw)  # type: ignore[arg-type]
        with no_fallback():
            compiled = mtpc.generate(model, prompts, 24, compile=True, **kw)  # type: ignore[arg-type]
        same_rows(eager, compiled)
    assert graphs() == 4 and counters["inductor"] and not counters["graph_break"]
