"""Static-shape decoding (``mtpc.generate(..., compile=True)``): the Llama family's caches in
fixed-capacity buffers, lengths, positions and visibility as tensors, and ONE step function of
fixed shape, compiled with ``torch.compile(fullgraph=True, dynamic=False)`` (on CUDA also
captured as a CUDA graph, ``mode="reduce-overhead"``). See docs/DECODING.md, "Compiled
decoding".

:class:`StaticEngine` holds the buffers and the step; :class:`StaticLayout` is the loop's
layout over it (``admit``, ``target``, ``release``: what autoregressive decoding uses).
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

    ``keys[l]``, ``values[l]``: ``(B, H_kv, S, D)`` buffers; ``slots``: ``(B, T)`` the new
    positions' slots, set by the step before the layers run.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys, self.values = keys, values
        self.slots: Tensor | None = None

    def update(
        self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Writes ``key``, ``value`` ``(B, H_kv, T, D)`` at the rows' slots; returns the whole
        buffers ``(B, H_kv, S, D)``."""
        assert self.slots is not None
        k, v = self.keys[layer_idx], self.values[layer_idx]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # k[b, :, slots[b, t]] = key[b, :, t]: an index_put_ (inductor writes it in place)
        k[rows, :, self.slots] = key.transpose(1, 2).to(k.dtype)  # (B, T, H_kv, D)
        v[rows, :, self.slots] = value.transpose(1, 2).to(v.dtype)
        return k, v


ATTENTION = ("sdpa", "eager")
"""The attention implementations the step's additive ``(B, 1, T, S)`` mask goes to."""


def supports_compile(model: Any, compile: bool | str = True) -> str | None:
    """Why ``model`` cannot decode with ``compile`` (its refusal, one line; None: it can)."""
    from mtpc.backbones.llama import LlamaBackbone

    backbone = model.backbone
    name, asked = type(backbone).__name__, f"compile={compile!r}"
    supported = (
        "supported: LlamaBackbone with transformers' own Llama layers (the tiny target, HF "
        f"Llama checkpoints) and attention {' or '.join(ATTENTION)}"
    )
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

    Slots ``[0, capacity)`` of a row hold its positions in order (slot = position: nothing
    is cut out of a row in autoregressive decoding); slots ``[capacity, capacity + scratch)``
    take the padding ids' keys and are never visible to a real query. ``valid`` ``(B, S)``
    says which slots each row holds, ``lengths`` ``(B,)`` how many: the next position.
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
        device, dtype = backbone.device, backbone.dtype
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        slots = capacity + chunk  # (the scratch: one slot per padding position of a pass)
        shape = (batch, heads, slots, dim)
        layers = backbone.num_layers
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.cache = SlotCache(keys, values)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)  # (B, S)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        if device.type == "cuda":  # CUDA graphs read the buffers in place
            for t in (*keys, *values, self.valid, self.lengths):
                torch._dynamo.mark_static_address(t)
        self.compiled: Callable[..., tuple[Tensor, Tensor]] | None = None
        self.failed: str | None = None  # why the compiled step fell back to eager
        self.ran_compiled = False

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def reset_rows(self, rows: Tensor) -> None:
        """Empties the rows ``rows`` ``(R,)`` (new prompts take their places)."""
        self.valid[rows] = False
        self.lengths[rows] = 0

    def step(
        self, ids: Tensor, real: Tensor, offsets: Tensor, inner: Tensor
    ) -> tuple[Tensor, Tensor]:
        """T new ids per row through every layer, appended to the rows' caches.

        Args:
            ids: ``(B, T)`` the new ids (anything where not ``real``).
            real: ``(B, T)`` bool, which ids are the row's own (the rest is padding: written
                to the scratch slots, seen by nothing, its output meaningless).
            offsets: ``(B, T)`` each id's position after the row's length (a chain's
                0..T-1; a tree node's depth).
            inner: ``(B, T, T)`` bool, which new ids each new id sees (a chain: causal; a
                tree: its ancestors); padding ids must see themselves.

        Returns:
            The trunk's pre-norm states ``(B, T, d)`` and the verifier's logits ``(B, T, V)``.
        """
        model, backbone = self.model, self.model.backbone
        b, t = ids.shape
        span = torch.arange(t, device=ids.device)  # (T,)
        scratch = self.capacity + span  # (T,)
        slots = torch.where(real, self.lengths[:, None] + span, scratch)  # (B, T)
        positions = self.lengths[:, None] + offsets  # (B, T)
        seen = self.valid[:, None, :].expand(b, t, -1).clone()  # (B, T, S)
        seen.scatter_(2, slots[:, None, :].expand(b, t, t), inner)
        self.cache.slots = slots
        hidden = model.embed(ids, None)  # (B, T, d)
        split, layers = model.split, backbone.num_layers
        trunk = backbone.run_static(hidden, range(split), positions, self.cache, seen)
        tail = backbone.run_static(trunk, range(split, layers), positions, self.cache, seen)
        self.valid.scatter_(1, slots, real)
        self.lengths.add_(real.sum(1))
        return trunk, model.verifier_logits(tail)  # (B, T, d), (B, T, V)

    def run(
        self, ids: Tensor, real: Tensor, offsets: Tensor, inner: Tensor
    ) -> tuple[Tensor, Tensor]:
        """:meth:`step`, compiled (eager after a compile failure, with a warning)."""
        if self.failed is not None:
            return self.step(ids, real, offsets, inner)
        if self.compiled is None:
            self.compiled = compile_step(self.step, self.backend, self.device)
        saved = (self.valid.clone(), self.lengths.clone())  # (a failure restores them)
        try:
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            with torch._dynamo.config.patch(
                fail_on_recompile_limit_hit=True, recompile_limit=limit
            ):
                out = self.compiled(ids, real, offsets, inner)
        except Exception as err:  # a compile or capture failure: never a wrong token
            self.failed = f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
            warnings.warn(
                f"compile=True: the compiled decode step failed ({self.failed}); decoding "
                "eagerly with the same static caches",
                RuntimeWarning,
                stacklevel=2,
            )
            self.valid.copy_(saved[0])
            self.lengths.copy_(saved[1])
            return self.step(ids, real, offsets, inner)
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
        engine = StaticEngine(model, batch, capacity, backend)
    kept[key] = engine  # the most recent last
    while len(kept) > ENGINES_KEPT:
        kept.pop(next(iter(kept)))
    return engine


def drop_engines(model: Any) -> None:
    """Frees ``model``'s engines (their buffers; the compiled graphs stay dynamo's)."""
    vars(model).pop(ENGINES_ATTRIBUTE, None)


class StaticLayout:
    """The rows of one decoding call in a :class:`StaticEngine`'s places (one per batch row):
    what autoregressive decoding needs of a layout (``admit``, ``target``, ``release``)."""

    def __init__(self, engine: StaticEngine) -> None:
        self.engine = engine
        self.places: list[Any] = [None] * engine.batch  # the row in each place, or None
        b, device = engine.batch, engine.device
        self._one = (  # a step of one id per row: its offsets (B, 1) and visibility (B, 1, 1)
            torch.zeros(b, 1, dtype=torch.long, device=device),
            torch.ones(b, 1, 1, dtype=torch.bool, device=device),
        )

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
        """One pass of one new id per row (``ids``: ``(1,)`` each; autoregressive decoding):
        the rows' trunk states ``(1, 1, d)`` and logits ``(1, V)``."""
        if any(tree is not None for tree in trees) or any(x.shape[0] != 1 for x in ids):
            raise ValueError("the static layout runs one new id per row (autoregressive)")
        engine = self.engine
        device, b = engine.device, engine.batch
        places = torch.tensor([self._place(row) for row in rows], device=device)  # (R,)
        new = torch.zeros(b, 1, dtype=torch.long, device=device)  # (B, 1)
        new[places] = torch.cat(list(ids))[:, None]
        real = torch.zeros(b, 1, dtype=torch.bool, device=device)
        real[places] = True
        trunk, out = engine.run(new, real, *self._one)
        trunk, out = trunk[places], out[places, 0]  # (R, 1, d), (R, V): copies
        return list(trunk[:, None]), list(out[:, None])

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Not yet: a speculative cycle's cut (``check_settings`` refuses compile with it)."""
        raise NotImplementedError("the static layout runs method='autoregressive' so far")

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """Not yet: the draft tail of a speculative cycle."""
        raise NotImplementedError("the static layout runs method='autoregressive' so far")

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave their places (a new prompt's admission empties them)."""
        gone = {id(row) for row in rows}
        self.places = [None if id(held) in gone else held for held in self.places]


def decode_static(
    model: Any,
    prompts: Sequence[Tensor],
    requests: Sequence[Any],
    size: int,
    admit: Callable[..., Any],
    step: Callable[..., Any],
) -> list[Any]:
    """``loop.decode`` of checked requests (``compile`` set: its backend) in a
    :class:`StaticEngine` of ``size`` rows, its capacity the longest prompt plus
    ``max_new_tokens``, rounded up to :data:`BUCKET`; each result's ``engine`` says what ran
    (``compiled``, or ``static`` after a fallback)."""
    from mtpc.decoding.loop import decode

    request = requests[0]
    longest = max(p.shape[0] for p in prompts) + request.max_new_tokens
    engine = engine_for(model, size, capacity_for(longest), str(request.compile))
    results = decode(model, prompts, requests, None, size, admit, step, StaticLayout(engine))
    for res in results:
        res.engine = engine.engine
    return results
