"""Static-shape decoding (``mtpc.generate(..., compile=True)``): the Llama family's caches in
fixed-capacity buffers, lengths, positions and visibility as tensors, and ONE step function of
fixed shape, compiled with ``torch.compile(fullgraph=True, dynamic=False)`` (on CUDA also
captured as a CUDA graph, ``mode="reduce-overhead"``). See docs/DECODING.md, "Compiled
decoding".

:class:`StaticEngine` holds the buffers and the step; :class:`StaticLayout` is the loop's
layout over it (``admit``, ``target``, ``release``: what autoregressive decoding uses).
EvaByte's engine (its windows and chunk RFAs in fixed buffers) is
``mtpc.decoding.static_eva.EvaStaticEngine``, the same step over its own caches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

BUCKET = 256
"""Capacities are multiples of this, so prompts of other lengths reuse the compiled graph."""

PREFILL_CHUNK = 32
"""Prompt ids per prefill pass (the last chunk padded): the prefill's one fixed shape."""

ENGINES_KEPT = 4
"""Engines (buffers and their compiled step) kept per model for the next calls."""

RECOMPILE_LIMIT = 64
"""Graphs of the one step function (a shape each: rows x capacity bucket x T) dynamo keeps
(its default, 8, would be reached by a session of several batch sizes and buckets); past it,
the step falls back to eager with a warning instead of running uncompiled in silence."""


class SlotCache:
    """The layers' KV cache as seen by transformers' attention (its ``update``): every new
    key and value goes to its row's own physical slot (an ``index_put_``), and the attention reads
    all ``capacity + scratch`` slots of the row (the mask hides the ones it must not see).

    ``keys[l - first]``, ``values[l - first]``: layer l's ``(B, H_kv, S, D)`` buffers (``first``:
    the first layer it covers; the draft tail's cache starts at the split); ``slots``:
    ``(B, T)`` the new positions' slots, set by the step before the layers run.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor], first: int = 0) -> None:
        self.keys, self.values, self.first = keys, values, first
        self.slots: Tensor | None = None

    def update(
        self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Writes ``key``, ``value`` ``(B, H_kv, T, D)`` at the rows' slots; returns the whole
        buffers ``(B, H_kv, S, D)``."""
        assert self.slots is not None
        k, v = self.keys[layer_idx - self.first], self.values[layer_idx - self.first]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # k[b, :, slots[b, t]] = key[b, :, t]: an index_put_ (inductor writes it in place)
        k[rows, :, self.slots] = key.transpose(1, 2).to(k.dtype)  # (B, T, H_kv, D)
        v[rows, :, self.slots] = value.transpose(1, 2).to(v.dtype)
        return k, v


ATTENTION = ("sdpa", "eager")
"""The attention implementations the step's additive ``(B, 1, T, S)`` mask goes to."""


def supports_compile(model: Any, compile: bool | str = True) -> str | None:
    """Why ``model`` cannot decode with ``compile`` (its refusal, one line; None: it can)."""
    from mtpc.backbones.evabyte import EvaByteBackbone
    from mtpc.backbones.llama import LlamaBackbone

    backbone = model.backbone
    name, asked = type(backbone).__name__, f"compile={compile!r}"
    supported = (
        "supported: LlamaBackbone with transformers' own Llama layers (the tiny target, HF "
        f"Llama checkpoints) or EvaByteBackbone, and attention {' or '.join(ATTENTION)}"
    )
    if type(backbone) is EvaByteBackbone:  # its own static attention (mtpc.decoding.static_eva)
        return None
    if type(backbone) is not LlamaBackbone:
        return f"{asked} does not support {name}; {supported}"
    if not backbone.native_layers:
        return f"{asked} does not support {name} with remote-code layers; {supported}"
    impl = getattr(backbone.config, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION:
        return f"{asked} does not support attention {impl!r}; {supported}"
    return None


def capacity_for(length: int, bucket: int = BUCKET) -> int:
    """Slots a row needs for ``length`` positions, rounded up to a multiple of ``bucket``."""
    return max(bucket, -(-length // bucket) * bucket)


class StaticEngine:
    """Fixed-capacity caches of ``batch`` rows over every layer of a Llama-family target, and
    the one step of fixed shape that runs T new ids per row through them.

    Slots ``[0, capacity)`` of a row hold its positions in order (slot = position: a row
    holds exactly its slots ``[0, length)``; a speculative cycle's rejected drafts are cut by
    rewinding ``lengths``, :meth:`rewind`); slots ``[capacity, capacity + scratch)`` take the
    padding ids' keys and are never visible to a real query. ``valid`` ``(B, S)`` says which
    slots each row holds, ``lengths`` ``(B,)`` how many: the next position.

    A draft with a LoRA tail (k > 0) has its own cache D of the tail's layers (adapter on):
    ``draft_cache``, ``draft_valid``, ``draft_lengths``, the same way (allocated on first use
    by :meth:`run_draft`; its step :meth:`draft_step`).
    """

    def __init__(
        self,
        model: Any,
        batch: int,
        capacity: int,
        backend: str = "inductor",
        chunk: int = PREFILL_CHUNK,
    ) -> None:
        backbone = model.backbone
        config = backbone.config
        self.model, self.batch, self.capacity, self.chunk = model, batch, capacity, chunk
        self.backend = backend
        head = getattr(model, "head", None)
        self.window = int(head.circuit.window) if head is not None else 1  # a chain's verify T
        device = backbone.device
        self._heads = int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        self._dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        # the scratch: one slot per padding position of a pass (a prefill chunk, a window)
        self.slots = capacity + max(chunk, self.window + 1)
        self.cache, self.valid, self.lengths = self._buffers(0, backbone.num_layers)
        self.slot_index = torch.arange(self.slots, device=device)  # (S,)
        self.draft_cache: SlotCache | None = None
        self.draft_valid = torch.zeros(0, dtype=torch.bool, device=device)
        self.draft_lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.compiled: Callable[..., tuple[Tensor, Tensor]] | None = None
        self.compiled_draft: Callable[..., Tensor] | None = None
        self.failed: str | None = None  # why the compiled step fell back to eager
        self.ran_compiled = False

    def _buffers(self, first: int, end: int) -> tuple[SlotCache, Tensor, Tensor]:
        """Key and value buffers of layers ``first..end-1``, their ``valid`` and ``lengths``."""
        backbone = self.model.backbone
        device, dtype = backbone.device, backbone.dtype
        shape = (self.batch, self._heads, self.slots, self._dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(first, end)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(first, end)]
        valid = torch.zeros(self.batch, self.slots, dtype=torch.bool, device=device)  # (B, S)
        lengths = torch.zeros(self.batch, dtype=torch.long, device=device)  # (B,)
        if device.type == "cuda":  # CUDA graphs read the buffers in place
            for t in (*keys, *values, valid, lengths):
                torch._dynamo.mark_static_address(t)
        return SlotCache(keys, values, first), valid, lengths

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def reset_rows(self, rows: Tensor) -> None:
        """Empties the rows ``rows`` ``(R,)`` (new prompts take their places)."""
        self.valid[rows] = False
        self.lengths[rows] = 0
        if self.draft_cache is not None:
            self.draft_valid[rows] = False
            self.draft_lengths[rows] = 0

    def rewind(self, lengths: Tensor) -> None:
        """Every row keeps its first ``lengths`` ``(B,)`` positions (at most its own): a
        chain's accepted prefix; the slots past it are free, never read, and the next pass
        writes over them."""
        self.lengths.copy_(lengths)
        torch.lt(self.slot_index[None], lengths[:, None], out=self.valid)  # slot = position

    def step(
        self, ids: Tensor, real: Tensor, offsets: Tensor, inner: Tensor
    ) -> tuple[Tensor, Tensor]:
        """T new ids per row through every layer, appended to the rows' caches.

        Args:
            ids: ``(B, T)`` the new ids (anything where not ``real``).
            real: ``(B, T)`` bool, which ids are the row's own, a prefix of each row (the
                rest is padding: written to the scratch slots, seen by nothing, its output
                meaningless).
            offsets: ``(B, T)`` each id's position after the row's length (a chain's
                0..T-1; a tree node's depth).
            inner: ``(B, T, T)`` bool, which new ids each new id sees (a chain: causal; a
                tree: its ancestors); padding ids must see themselves.

        Returns:
            The trunk's pre-norm states ``(B, T, d)`` and the verifier's logits ``(B, T, V)``.
        """
        model, backbone = self.model, self.model.backbone
        hidden = model.embed(ids, None)  # (B, T, d)
        split, layers = model.split, backbone.num_layers
        positions, seen = self._prepare(self.cache, self.valid, self.lengths, real, offsets, inner)
        trunk = backbone.run_static(hidden, range(split), positions, self.cache, seen)
        tail = backbone.run_static(trunk, range(split, layers), positions, self.cache, seen)
        self._append(self.cache, self.valid, self.lengths, real)
        return trunk, model.verifier_logits(tail)  # (B, T, d), (B, T, V)

    def draft_step(self, hidden: Tensor, real: Tensor, offsets: Tensor, inner: Tensor) -> Tensor:
        """The draft tail (layers split..L-1, the LoRA adapter on: the caller switches it) on
        T kept trunk states per row ``hidden`` ``(B, T, d)``, appended to cache D (``real``,
        ``offsets``, ``inner``: as :meth:`step`). Returns its outputs ``(B, T, d)``."""
        cache = self.draft_cache
        assert cache is not None
        backbone = self.model.backbone
        valid, lengths = self.draft_valid, self.draft_lengths
        positions, seen = self._prepare(cache, valid, lengths, real, offsets, inner)
        out = backbone.run_static(
            hidden, range(self.model.split, backbone.num_layers), positions, cache, seen
        )
        self._append(cache, valid, lengths, real)
        return out

    def _prepare(
        self, cache: SlotCache, valid: Tensor, lengths: Tensor, real: Tensor, offsets: Tensor,
        inner: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Sets the new ids' slots on ``cache``; their positions ``(B, T)`` and visibility
        ``(B, T, S)`` (the row's valid slots, and ``inner`` at the new ones)."""
        b, t = real.shape
        span = torch.arange(t, device=real.device)  # (T,)
        scratch = self.capacity + span  # (T,)
        slots = torch.where(real, lengths[:, None] + span, scratch)  # (B, T)
        seen = valid[:, None, :].expand(b, t, -1).clone()  # (B, T, S)
        seen.scatter_(2, slots[:, None, :].expand(b, t, t), inner)
        cache.slots = slots
        return lengths[:, None] + offsets, seen

    @staticmethod
    def _append(cache: SlotCache, valid: Tensor, lengths: Tensor, real: Tensor) -> None:
        assert cache.slots is not None
        valid.scatter_(1, cache.slots, real)
        lengths.add_(real.sum(1))

    def run(
        self, ids: Tensor, real: Tensor, offsets: Tensor, inner: Tensor
    ) -> tuple[Tensor, Tensor]:
        """:meth:`step`, compiled (eager after a compile failure, with a warning)."""
        if self.failed is None and self.compiled is None:
            self.compiled = compile_step(self.step, self.backend, self.device)
        state = (self.valid, self.lengths)
        return self._call(self.compiled, self.step, (ids, real, offsets, inner), state)

    def run_draft(self, hidden: Tensor, real: Tensor, offsets: Tensor, inner: Tensor) -> Tensor:
        """:meth:`draft_step` with the adapter on, compiled (eager after a failure)."""
        if self.draft_cache is None:
            model = self.model
            self.draft_cache, self.draft_valid, self.draft_lengths = self._buffers(
                model.split, model.backbone.num_layers
            )
        if self.failed is None and self.compiled_draft is None:
            self.compiled_draft = compile_step(self.draft_step, self.backend, self.device)
        state = (self.draft_valid, self.draft_lengths)
        with self.model.backbone.adapter(True):
            out: Tensor = self._call(
                self.compiled_draft, self.draft_step, (hidden, real, offsets, inner), state
            )
        return out

    def _call(
        self, compiled: Callable[..., Any] | None, eager: Callable[..., Any],
        args: tuple[Tensor, ...], state: tuple[Tensor, Tensor],
    ) -> Any:  # fmt: skip
        """``compiled(*args)``, or ``eager(*args)`` after a failure (``state``: the valid
        and lengths it updates, restored before the eager retry)."""
        if self.failed is not None or compiled is None:
            return eager(*args)
        saved = tuple(t.clone() for t in state)  # (a failure restores them)
        try:
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            with torch._dynamo.config.patch(
                fail_on_recompile_limit_hit=True, recompile_limit=limit
            ):
                out = compiled(*args)
        except Exception as err:  # a compile or capture failure: never a wrong token
            self.failed = f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
            warnings.warn(
                f"compile=True: the compiled decode step failed ({self.failed}); decoding "
                "eagerly with the same static caches",
                RuntimeWarning,
                stacklevel=3,
            )
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)
            return eager(*args)
        self.ran_compiled = True
        return out

    @property
    def engine(self) -> str:
        """What ran: ``compiled``, or ``static`` (the same caches, eagerly: a fallback)."""
        return "compiled" if self.failed is None and self.ran_compiled else "static"


def compile_step(
    step: Callable[..., Any], backend: str, device: torch.device
) -> Callable[..., Any]:
    """``torch.compile`` of a step: one graph (``fullgraph``), fixed shapes; CUDA graphs on
    CUDA with inductor."""
    options: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": backend}
    if backend == "inductor" and device.type == "cuda":
        options["mode"] = "reduce-overhead"
    return torch.compile(step, **options)


ENGINES_ATTRIBUTE = "_mtpc_static_engines"
"""Where a model keeps its engines (on the model: they live and go with it; a registry
outside would keep every model alive through its engines)."""


def engine_for(model: Any, batch: int, capacity: int, backend: str) -> StaticEngine:
    """An engine of ``batch`` rows of ``capacity`` slots for ``model``: the last calls' one
    when its shape matches (its graph is compiled already), else a new one."""
    kept: dict[tuple[Any, ...], StaticEngine] = vars(model).setdefault(ENGINES_ATTRIBUTE, {})
    key = (batch, capacity, backend, model.backbone.dtype, str(model.backbone.device))
    engine = kept.pop(key, None)
    if engine is None or engine.failed is not None:
        engine = engine_class(model)(model, batch, capacity, backend)
    kept[key] = engine  # the most recent last
    while len(kept) > ENGINES_KEPT:
        kept.pop(next(iter(kept)))
    return engine


def engine_class(model: Any) -> type[StaticEngine]:
    """The engine of ``model``'s backbone: EvaByte's windows and RFAs
    (``static_eva.EvaStaticEngine``), else the Llama family's slot caches."""
    if hasattr(model.backbone, "run_rows"):  # EvaByte (as loop.decode picks its layout)
        from mtpc.decoding.static_eva import EvaStaticEngine

        return EvaStaticEngine
    return StaticEngine


def drop_engines(model: Any) -> None:
    """Frees ``model``'s engines (their buffers; the compiled graphs stay dynamo's)."""
    vars(model).pop(ENGINES_ATTRIBUTE, None)


class StaticLayout:
    """The rows of one decoding call in a :class:`StaticEngine`'s places (one per batch row):
    the loop's layout (``admit``, ``target``, ``keep``, ``draft``, ``release``) for
    autoregressive decoding and the speculative chain."""

    def __init__(self, engine: StaticEngine) -> None:
        self.engine = engine
        self.places: list[Any] = [None] * engine.batch  # the row in each place, or None
        self._shapes: dict[int, tuple[Tensor, Tensor]] = {}  # T -> (offsets, causal inner)
        self._eyes: dict[int, Tensor] = {}  # T -> (T, T) identity: padding sees itself
        self.base = engine.lengths.clone()  # (B,) the lengths before the last pass

    def _place(self, row: Any) -> int:
        return next(i for i, held in enumerate(self.places) if held is row)

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills ``prompts`` ((T_b,) each) into free places, ``chunk`` ids per pass; returns
        the rows' trunk states ``(1, T_b, d)`` and their last position's logits ``(1, V)``."""
        engine = self.engine
        free = [i for i, held in enumerate(self.places) if held is None]
        if len(rows) > len(free):
            raise ValueError(f"{len(rows)} new rows but {len(free)} free places")
        places = free[: len(rows)]
        for i, row in zip(places, rows, strict=True):
            self.places[i] = row
        device, b, chunk = engine.device, engine.batch, engine.chunk
        engine.reset_rows(torch.tensor(places, device=device))
        longest = max(p.shape[0] for p in prompts)
        offsets = torch.arange(chunk, device=device).expand(b, chunk)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
        eye = torch.eye(chunk, dtype=torch.bool, device=device)
        states: list[list[Tensor]] = [[] for _ in rows]
        logits: list[Tensor | None] = [None] * len(rows)
        for start in range(0, longest, chunk):
            ids = torch.zeros(b, chunk, dtype=torch.long, device=device)  # (B, C)
            real = torch.zeros(b, chunk, dtype=torch.bool, device=device)
            for i, prompt in zip(places, prompts, strict=True):
                part = prompt[start : start + chunk]
                ids[i, : part.shape[0]], real[i, : part.shape[0]] = part, True
            inner = (causal & real[:, None, :]) | eye  # (B, C, C)
            trunk, out = engine.run(ids, real, offsets, inner)
            for j, (i, prompt) in enumerate(zip(places, prompts, strict=True)):
                count = min(chunk, prompt.shape[0] - start)
                if count > 0:
                    states[j].append(trunk[i : i + 1, :count].clone())
                if count > 0 and start + count == prompt.shape[0]:
                    logits[j] = out[i, count - 1 : count].clone()  # (1, V)
        return [torch.cat(s, 1) for s in states], logits  # type: ignore[return-value]

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Any], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One pass of each row's new ids ``(T_b,)`` (one id: autoregressive decoding and the
        ``recompute`` pass; a chain's pending token and drafts: at most the window), padded to
        the pass's fixed T (1, else the window): the rows' trunk states ``(1, T_b, d)`` and
        logits ``(T_b, V)``."""
        engine = self.engine
        widths = [x.shape[0] for x in ids]
        width = 1 if max(widths) == 1 else engine.window
        if any(tree is not None for tree in trees) or max(widths) > width:
            raise ValueError("the static layout runs chains of at most the window per row")
        device, b = engine.device, engine.batch
        places = self._places(rows)  # (R,)
        offsets, inner = self._shape(width)
        new = torch.zeros(b, width, dtype=torch.long, device=device)  # (B, T)
        real = torch.zeros(b, width, dtype=torch.bool, device=device)
        if width == 1:
            new[places] = torch.cat(list(ids))[:, None]
            real[places] = True
        else:
            new[places, : max(widths)] = torch.nn.utils.rnn.pad_sequence(list(ids), True)
            count = torch.tensor(widths, device=device)
            real[places] = offsets[0][None] < count[:, None]
            inner = (inner & real[:, None, :]) | self._eye(width)
        self.base = engine.lengths.clone()  # (B,) before the pass: what keep cuts back to
        trunk, out = engine.run(new, real, offsets, inner)
        trunk, out = trunk[places], out[places]  # (R, T, d), (R, T, V): copies
        if width == 1:
            return list(trunk[:, None]), list(out)
        states = [trunk[i : i + 1, :t] for i, t in enumerate(widths)]
        return states, [out[i, :t] for i, t in enumerate(widths)]

    def _places(self, rows: Sequence[Any]) -> Tensor:
        """The rows' places ``(R,)``."""
        return torch.tensor([self._place(row) for row in rows], device=self.engine.device)

    def _shape(self, width: int) -> tuple[Tensor, Tensor]:
        """A pass of ``width`` ids per row: offsets ``(B, T)`` and causal ``inner`` ``(B, T, T)``."""
        if width not in self._shapes:
            b, device = self.engine.batch, self.engine.device
            offsets = torch.arange(width, device=device).repeat(b, 1)
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            self._shapes[width] = (offsets, causal.repeat(b, 1, 1))
        return self._shapes[width]

    def _eye(self, width: int) -> Tensor:
        """The ``(T, T)`` identity of a pass of ``width`` ids, built once per width."""
        if width not in self._eyes:
            self._eyes[width] = torch.eye(width, dtype=torch.bool, device=self.engine.device)
        return self._eyes[width]

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Each row keeps the first ``keeps[i]`` positions of the last pass (a chain's
        pending token and accepted drafts): its length rewinds to them, one tensor op for all
        rows (:meth:`StaticEngine.rewind`); the rest of its slots are free."""
        if not rows:
            return
        if any(not isinstance(k, int) for k in keeps):
            raise ValueError("the static layout keeps a chain's prefix (token trees: not yet)")
        engine = self.engine
        lengths = engine.lengths.clone()
        places = self._places(rows)
        lengths[places] = self.base[places] + torch.tensor(list(keeps), device=engine.device)
        engine.rewind(lengths)

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """The draft tail over each row's kept trunk states ``(1, K_b, d)``: its last output
        ``(1, d)`` (None: no state). k = 0: the trunk's last state itself; k > 0: the tail's
        layers with the adapter on over cache D, in passes of a fixed T (the window + 1 in a
        cycle, the prefill chunk over a prompt)."""
        if not states:
            return []
        engine, model = self.engine, self.engine.model
        if not model.k:  # no draft tail: the draft reads the trunk's (= verifier's) last state
            return [s[:, -1] if s.shape[1] else None for s in states]
        widths = [s.shape[1] for s in states]
        longest = max(widths)
        if not longest:
            return [None] * len(rows)
        width = engine.window + 1 if longest <= engine.window + 1 else engine.chunk
        device, b = engine.device, engine.batch
        places = self._places(rows)
        offsets, causal = self._shape(width)
        flat = torch.nn.utils.rnn.pad_sequence([s[0] for s in states], True)  # (R, K, d)
        count = torch.tensor(widths, device=device)  # (R,)
        last: list[Tensor | None] = [None] * len(rows)
        for start in range(0, longest, width):  # one pass in a cycle; a prompt's chunks
            part = flat[:, start : start + width]  # (R, <= T, d)
            hidden = flat.new_zeros(b, width, flat.shape[2])  # (B, T, d)
            hidden[places, : part.shape[1]] = part
            real = torch.zeros(b, width, dtype=torch.bool, device=device)
            real[places] = offsets[0][None] < (count - start)[:, None]
            inner = (causal & real[:, None, :]) | self._eye(width)
            out = engine.run_draft(hidden, real, offsets, inner)  # (B, T, d)
            ends = out[places, (count - 1 - start).clamp(0, width - 1)]  # (R, d): copies
            for j, k in enumerate(widths):  # the rows whose last state is in this pass
                if start < k <= start + width:
                    last[j] = ends[j : j + 1]  # (1, d)
        return last

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave their places (a new prompt's admission empties them)."""
        gone = {id(row) for row in rows}
        self.places = [None if id(held) in gone else held for held in self.places]


def decode_static(
    model: Any,
    prompts: Sequence[Tensor],
    requests: Sequence[Any],
    size: int,
    admit: Callable[..., Any] | None = None,
    step: Callable[..., Any] | None = None,
    proposer: Any = None,
) -> list[Any]:
    """``loop.decode`` of checked requests (``compile`` set: its backend) in a
    :class:`StaticEngine` of ``size`` rows, its capacity the longest prompt plus
    ``max_new_tokens`` (plus a window for a chain's last verify pass), rounded up to
    :data:`BUCKET`; autoregressive (``admit``, ``step``) or speculative (``proposer``: a
    chain). Each result's ``engine`` says what ran (``compiled``, or ``static`` after a
    fallback)."""
    from mtpc.decoding.loop import decode

    request = requests[0]
    longest = max(p.shape[0] for p in prompts) + request.max_new_tokens
    if proposer is not None:  # a verify pass writes up to a window past the emitted tokens
        longest += model.head.circuit.window + 1
    engine = engine_for(model, size, capacity_for(longest), str(request.compile))
    layout = StaticLayout(engine)
    results = decode(model, prompts, requests, proposer, size, admit, step, layout)
    for res in results:
        res.engine = engine.engine
    return results
