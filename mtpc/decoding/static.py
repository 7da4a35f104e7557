"""Static-shape decoding (``mtpc.generate(..., compile=True)``): which backbones it supports,
the engines kept per model, and :class:`StaticLayout`, the loop's layout over an engine. The
engine (fixed-capacity buffers, ONE compiled step of fixed shape) is
``static_step.StaticEngine``, EvaByte's ``static_eva.EvaStaticEngine``. See docs/DECODING.md,
"Compiled decoding".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mtpc.decoding.layout import Stream, index_of
from mtpc.decoding.static_step import StaticEngine

BUCKET = 256
"""Capacities are multiples of this, so prompts of other lengths reuse the compiled graph."""

ENGINES_KEPT = 4
"""Engines (buffers and their compiled step) kept per model for the next calls."""

ATTENTION = ("sdpa", "eager")
"""The attention implementations the step's additive ``(B, 1, T, S)`` mask goes to."""


def supports_compile(model: Any, compile: bool | str = True) -> str | None:
    """Why ``model`` cannot decode with ``compile`` (its refusal, one line; None: it can)."""
    from mtpc.backbones.evabyte import EvaByteBackbone
    from mtpc.backbones.llama import LlamaBackbone
    from mtpc.backbones.llama3_byte import Llama3ByteBackbone

    backbone = model.backbone
    name, asked = type(backbone).__name__, f"compile={compile!r}"
    supported = (
        "supported: LlamaBackbone with transformers' own Llama layers (the tiny target, HF "
        "Llama checkpoints), Llama3ByteBackbone or EvaByteBackbone, and attention "
        f"{' or '.join(ATTENTION)}"
    )
    if type(backbone) is EvaByteBackbone:  # its own static attention (mtpc.decoding.static_eva)
        return None
    if type(backbone) not in (LlamaBackbone, Llama3ByteBackbone):
        return f"{asked} does not support {name}; {supported}"
    if not backbone.native_layers and type(backbone) is not Llama3ByteBackbone:
        return f"{asked} does not support {name} with remote-code layers; {supported}"
    impl = getattr(backbone.config, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION:
        return f"{asked} does not support attention {impl!r}; {supported}"
    return None


def capacity_for(length: int, bucket: int = BUCKET) -> int:
    """Slots a row needs for ``length`` positions, rounded up to a multiple of ``bucket``."""
    return max(bucket, -(-length // bucket) * bucket)


ENGINES_ATTRIBUTE = "_mtpc_static_engines"
"""Where a model keeps its engines (on the model: they live and go with it; a registry
outside would keep every model alive through its engines)."""


def engine_for(
    model: Any, batch: int, capacity: int, backend: str | None, widest: int = 0
) -> StaticEngine:
    """An engine of ``batch`` rows of ``capacity`` slots for ``model`` (``widest``: a token
    tree's pass, its scratch): the last calls' one when its shape matches (its graph is
    compiled already), else a new one."""
    kept: dict[tuple[Any, ...], StaticEngine] = vars(model).setdefault(ENGINES_ATTRIBUTE, {})
    key = (batch, capacity, backend, widest, model.backbone.dtype, str(model.backbone.device))
    engine = kept.pop(key, None)
    if engine is None or engine.failed is not None:
        engine = engine_class(model)(model, batch, capacity, backend, widest=widest)
    kept[key] = engine  # the most recent last
    while len(kept) > ENGINES_KEPT:
        kept.pop(next(iter(kept)))
    return engine


def engine_class(model: Any) -> type[StaticEngine]:
    """The engine of ``model``'s backbone: EvaByte's windows and RFAs
    (``static_eva.EvaStaticEngine``), else the Llama family's slot caches."""
    from mtpc.backbones.evabyte import EvaByteBackbone

    if isinstance(model.backbone, EvaByteBackbone):
        from mtpc.decoding.static_eva import EvaStaticEngine

        return EvaStaticEngine
    return StaticEngine


def drop_engines(model: Any) -> None:
    """Frees ``model``'s engines (their buffers; the compiled graphs stay dynamo's)."""
    vars(model).pop(ENGINES_ATTRIBUTE, None)


class StaticLayout:
    """The rows of one decoding call in a :class:`StaticEngine`'s places (one per batch row):
    the loop's layout for autoregressive decoding, the speculative chain and token trees."""

    def __init__(self, engine: StaticEngine, widest: int = 0) -> None:
        self.engine = engine
        self.widest = widest  # a token tree's pass: its fixed T (its budget + 1)
        self.places: list[Any] = [None] * engine.batch  # the row in each place, or None
        self._shapes: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # T -> _shape's
        self.base = engine.lengths.clone()  # (B,) the lengths before the last pass
        # id(row) -> (its place, its layout.Stream): an uncompiled engine's new row, prefilled
        # alone and adopted at its first pass (EvaStaticEngine.adopt)
        self.fresh: dict[int, tuple[int, Stream]] = {}

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills ``prompts`` ((T_b,) each) into free places, ``chunk`` ids per pass; returns
        the rows' trunk states ``(1, T_b, d)`` and their last position's logits ``(1, V)``."""
        engine = self.engine
        free = [i for i, held in enumerate(self.places) if held is None]
        if len(rows) > len(free):
            raise ValueError(f"{len(rows)} new rows but {len(free)} free places")
        at, chunk = free[: len(rows)], engine.chunk
        for i, row in zip(at, rows, strict=True):
            self.places[i] = row
        places = torch.tensor(at, device=engine.device)
        engine.reset_rows(places)
        if engine.backend is None and 2 * len(rows) < engine.batch:
            # uncompiled, fewer than half the rows (a chunk pass would compute every row for
            # them): each prompt prefilled alone in a layout.Stream (as decoding it alone runs
            # it), adopted at its first pass (_join)
            states, logits = [], []
            for place, row, prompt in zip(at, rows, prompts, strict=True):
                stream = Stream(engine.model)
                (state,), (last,) = stream.admit([row], [prompt])
                self.fresh[id(row)] = (place, stream)
                states.append(state)
                logits.append(last)
            return states, logits
        flat = torch.nn.utils.rnn.pad_sequence(list(prompts), True)  # (R, L)
        count = torch.tensor([p.shape[0] for p in prompts], device=engine.device)  # (R,)
        parts: list[list[Tensor]] = [[] for _ in rows]
        ends: list[Tensor | None] = [None] * len(rows)
        for start in range(0, flat.shape[1], chunk):
            part = flat[:, start : start + chunk]
            trunk, out = engine.run(*self._pass(places, part, count - start, chunk))
            for j, (i, prompt) in enumerate(zip(at, prompts, strict=True)):
                n = min(chunk, prompt.shape[0] - start)
                if n > 0:
                    parts[j].append(trunk[i : i + 1, :n].clone())
                if n > 0 and start + n == prompt.shape[0]:
                    ends[j] = out[i, n - 1 : n].clone()  # (1, V)
        return [torch.cat(s, 1) for s in parts], ends  # type: ignore[return-value]

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Any], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One pass of each row's new ids ``(T_b,)`` (one id: autoregressive decoding and the
        ``recompute`` pass; a chain's pending token and drafts: at most the window; a token
        tree's root and nodes, ``trees``' ``(depth (T_b,), mask (T_b, T_b))``: at most
        :attr:`widest`), padded to the pass's fixed T (1; the window; a tree pass:
        :attr:`widest`): the rows' trunk states ``(1, T_b, d)`` and logits ``(T_b, V)``."""
        engine = self.engine
        self._join()
        widths = [x.shape[0] for x in ids]
        tree = any(t is not None for t in trees)
        width = self.widest if tree else 1 if max(widths) == 1 else engine.window
        if max(widths) > width:
            raise ValueError(f"a pass of {max(widths)} ids in a static layout of {width}")
        places = self._places(rows)  # (R,)
        if width == 1:  # the latency path: no padding, every row's one id real
            offsets, inner, _ = self._shape(1)
            new = torch.zeros(engine.batch, 1, dtype=torch.long, device=engine.device)
            real = torch.zeros(engine.batch, 1, dtype=torch.bool, device=engine.device)
            new[places] = torch.cat(list(ids))[:, None]
            real[places] = True
        else:
            flat = torch.nn.utils.rnn.pad_sequence(list(ids), True)  # (R, T_max)
            count = torch.tensor(widths, device=engine.device)
            new, real, offsets, inner = self._pass(places, flat, count, width, trees)
        self.base = engine.lengths.clone()  # (B,) before the pass: what keep cuts back to
        trunk, out = engine.run(new, real, offsets, inner)
        trunk, out = trunk[places], out[places]  # (R, T, d), (R, T, V): copies
        if width == 1:
            return list(trunk[:, None]), list(out)
        states = [trunk[i : i + 1, :t] for i, t in enumerate(widths)]
        return states, [out[i, :t] for i, t in enumerate(widths)]

    def _places(self, rows: Sequence[Any]) -> Tensor:
        """The rows' places ``(R,)``."""
        return torch.tensor(index_of(self.places, rows), device=self.engine.device)

    def _shape(self, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """A pass of ``width`` ids per row: offsets ``(B, T)``, causal ``inner`` ``(B, T, T)``
        and the ``(T, T)`` identity (padding sees itself), built once per width."""
        if width not in self._shapes:
            b, device = self.engine.batch, self.engine.device
            offsets = torch.arange(width, device=device).repeat(b, 1)
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            eye = torch.eye(width, dtype=torch.bool, device=device)
            self._shapes[width] = (offsets, causal.repeat(b, 1, 1), eye)
        return self._shapes[width]

    def _pass(
        self, places: Tensor, values: Tensor, count: Tensor, width: int, trees: Sequence[Any] = ()
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One pass of fixed T = ``width``: the rows' ``values`` ``(R, <= T, ...)`` at their
        places of a zero ``(B, T, ...)`` batch, ``real`` ``(B, T)`` (each row's first ``count``
        ``(R,)``), ``offsets`` ``(B, T)`` and ``inner`` ``(B, T, T)`` (causal, or ``trees``'
        depths and ancestor masks)."""
        engine = self.engine
        offsets, inner, eye = self._shape(width)
        shape = (engine.batch, width, *values.shape[2:])
        batch = torch.zeros(shape, dtype=values.dtype, device=engine.device)
        batch[places, : values.shape[1]] = values
        real = torch.zeros(engine.batch, width, dtype=torch.bool, device=engine.device)
        real[places] = offsets[0][None] < count[:, None]
        if any(t is not None for t in trees):  # a chain row's: causal
            offsets, inner = offsets.clone(), inner.clone()
            for i, layout in zip(places.tolist(), trees, strict=True):
                if layout is not None:
                    t = layout[0].shape[0]
                    offsets[i, :t], inner[i, :t, :t] = layout
        return batch, real, offsets, (inner & real[:, None, :]) | eye

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Each row keeps the first ``keeps[i]`` positions of the last pass (a chain's
        pending token and accepted drafts), or the ``(K_i,)`` offsets ``keeps[i]`` (a token
        tree's root and accepted path: their keys and values move down to the first K_i
        slots of the pass, :meth:`StaticEngine.compact`, one gather and write per buffer for
        all rows); its length rewinds to them (:meth:`StaticEngine.rewind`); the rest of its
        slots are free."""
        if not rows:
            return
        engine = self.engine
        places = self._places(rows)  # (R,)
        counts = [k if isinstance(k, int) else k.shape[0] for k in keeps]
        if not all(isinstance(k, int) for k in keeps):
            # (R, K): each row's kept offsets (a prefix: 0..k-1), then j itself
            device = engine.device
            kept = [torch.arange(k, device=device) if isinstance(k, int) else k for k in keeps]
            index = torch.nn.utils.rnn.pad_sequence(kept, True, padding_value=-1)  # (R, K)
            span = torch.arange(index.shape[1], device=device).expand_as(index)
            engine.compact(places, self.base[places], torch.where(index < 0, span, index))
        lengths = engine.lengths.clone()
        lengths[places] = self.base[places] + torch.tensor(counts, device=engine.device)
        engine.rewind(lengths)

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """The draft tail over each row's kept trunk states ``(1, K_b, d)``: its last output
        ``(1, d)`` (None: no state). k = 0: the trunk's last state itself; k > 0: the tail's
        layers with the adapter on over cache D, in passes of a fixed T (the window + 1 in a
        cycle, the prefill chunk over a prompt)."""
        if self.fresh and any(id(row) in self.fresh for row in rows):
            return self._draft_fresh(rows, states)
        engine, model = self.engine, self.engine.model
        if not model.k:  # no draft tail: the draft reads the trunk's (= verifier's) last state
            return [s[:, -1] if s.shape[1] else None for s in states]
        widths = [s.shape[1] for s in states]
        longest = max(widths, default=0)
        if not longest:
            return [None] * len(rows)
        width = engine.window + 1 if longest <= engine.window + 1 else engine.chunk
        places = self._places(rows)
        flat = torch.nn.utils.rnn.pad_sequence([s[0] for s in states], True)  # (R, K, d)
        count = torch.tensor(widths, device=engine.device)  # (R,)
        last: list[Tensor | None] = [None] * len(rows)
        for start in range(0, longest, width):  # one pass in a cycle; a prompt's chunks
            part = flat[:, start : start + width]  # (R, <= T, d)
            out = engine.run_draft(*self._pass(places, part, count - start, width))  # (B, T, d)
            ends = out[places, (count - 1 - start).clamp(0, width - 1)]  # (R, d): copies
            for j, k in enumerate(widths):  # the rows whose last state is in this pass
                if start < k <= start + width:
                    last[j] = ends[j : j + 1]  # (1, d)
        return last

    def _draft_fresh(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """:meth:`draft` with fresh rows among ``rows``: theirs alone in their streams (then
        adopted), the others' on the engine."""
        fresh = [n for n, row in enumerate(rows) if id(row) in self.fresh]
        out: list[Tensor | None] = [None] * len(rows)
        for n in fresh:
            (out[n],) = self.fresh[id(rows[n])][1].draft([rows[n]], [states[n]])
        self._join()
        rest = [n for n in range(len(rows)) if n not in fresh]
        lasts = self.draft([rows[n] for n in rest], [states[n] for n in rest])
        for n, last in zip(rest, lasts, strict=True):
            out[n] = last
        return out

    def _join(self) -> None:
        """The fresh rows' streams go into the engine (:meth:`EvaStaticEngine.adopt`)."""
        for place, stream in self.fresh.values():
            self.engine.adopt(place, stream.caches)  # type: ignore[attr-defined]
        self.fresh = {}

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave their places (a new prompt's admission empties them)."""
        gone = {id(row) for row in rows}
        self.fresh = {key: fresh for key, fresh in self.fresh.items() if key not in gone}
        self.places = [None if id(held) in gone else held for held in self.places]


def decode_static(
    model: Any,
    prompts: Sequence[Tensor],
    requests: Sequence[Any],
    size: int,
    step: Callable[..., Any] | None = None,
    proposer: Any = None,
) -> list[Any]:
    """``loop.decode`` of checked requests in a :class:`StaticLayout` over an engine of
    ``size`` rows, its capacity the longest prompt plus ``max_new_tokens`` (plus a verify pass:
    a chain's window + 1, a token tree's budget + 1), rounded up to :data:`BUCKET`, compiled
    with the requests' ``compile`` backend (False: uncompiled, EvaByte's batches);
    autoregressive (``step``) or speculative (``proposer``). A compiled call's results say
    what ran in ``engine`` (``compiled``, or ``static`` after a fallback)."""
    from mtpc.decoding.loop import decode

    request = requests[0]
    widest = request.tree_budget + 1 if request.tree_budget and proposer is not None else 0
    longest = max(p.shape[0] for p in prompts) + request.max_new_tokens
    if proposer is not None:  # a verify pass writes up to a window (a tree) past the tokens
        longest += max(model.head.circuit.window + 1, widest)
    backend = str(request.compile) if request.compile else None
    engine = engine_for(model, size, capacity_for(longest), backend, widest)
    results = decode(model, prompts, requests, proposer, size, step, StaticLayout(engine, widest))
    for res in results if backend else ():
        res.engine = engine.engine
    return results
