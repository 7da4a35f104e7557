"""The static step's machinery: a batch's caches in fixed-capacity buffers (:class:`SlotCache`,
the Llama family's; EvaByte's: ``static_eva``), lengths, positions and visibility as tensors,
and ONE step function of fixed shape (:class:`StaticEngine`), compiled by :func:`compile_step`.
The layout over it and the engines kept per model: ``static``. See docs/DECODING.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

PREFILL_CHUNK = 32
"""Prompt ids per prefill pass (the last chunk padded): the prefill's one fixed shape."""

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
    by :meth:`run_draft`; its step :meth:`draft_step`). A token tree's accepted path moves
    down to the pass's first slots (:meth:`compact`) before the rewind. The byte Llama's
    embedding reads each id's last ids: ``slot_ids`` ``(B, S)`` holds the rows' ids by slot.
    """

    def __init__(
        self,
        model: Any,
        batch: int,
        capacity: int,
        backend: str | None = "inductor",
        chunk: int = PREFILL_CHUNK,
        widest: int = 0,
    ) -> None:
        backbone = model.backbone
        config = backbone.config
        self.model, self.batch, self.capacity, self.chunk = model, batch, capacity, chunk
        self.backend = backend
        self.window = int(model.head.circuit.window)  # a chain's verify T
        device = backbone.device
        heads = config.num_attention_heads
        self._heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self._dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        # the scratch: one slot per padding position of the widest pass (a prefill chunk, a
        # window, ``widest``: a token tree's pass)
        self.widest = max(chunk, self.window + 1, widest)
        self.slots = capacity + self.widest
        self.cache, self.valid, self.lengths = self._buffers(0, backbone.num_layers)
        self.slot_index = torch.arange(self.slots, device=device)  # (S,)
        self.draft_cache: SlotCache | None = None
        self.draft_valid = torch.zeros(0, dtype=torch.bool, device=device)
        self.draft_lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.compiled: dict[str, Callable[..., Any]] = {}  # step's name -> its compiled graph
        self.failed: str | None = None  # why the compiled step fell back to eager
        self.ran_compiled = False
        # the byte Llama's embedding reads each id's last ``maxlen`` ids: the ids by slot
        self.slot_ids: Tensor | None = None  # (B, S)
        if backbone.needs_history:
            self.slot_ids = torch.zeros(batch, self.slots, dtype=torch.long, device=device)
            if device.type == "cuda":  # read and written in place, as the caches
                torch._dynamo.mark_static_address(self.slot_ids)
            backbone.expansion(device)  # its lookup tables built (and on the device) eagerly

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

    def compact(self, places: Tensor, base: Tensor, keep: Tensor) -> None:
        """Each row ``places[r]`` keeps the positions ``base[r] + keep[r, j]`` of its last pass
        (a token tree's root and accepted path) as ``base[r] + j``: one gather and one
        ``index_put_`` per layer's buffer for all rows (its lengths: :meth:`rewind`).

        Args:
            places: ``(R,)`` the rows' places.
            base: ``(R,)`` their lengths before the pass.
            keep: ``(R, K)`` the kept offsets from ``base`` (a row's past its own count: ``j``
                itself, which copies a slot onto itself).
        """
        rows = places[:, None]  # (R, 1)
        src = base[:, None] + keep  # (R, K)
        dst = base[:, None] + torch.arange(keep.shape[1], device=keep.device)  # (R, K)
        for buffer in (*self.cache.keys, *self.cache.values):  # (B, H_kv, S, D) each
            buffer[rows, :, dst] = buffer[rows, :, src]  # (R, K, H_kv, D): gathered first
        if self.slot_ids is not None:
            self.slot_ids[rows, dst] = self.slot_ids[rows, src]  # (R, K)

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
        if self.slot_ids is None:
            hidden = model.embed(ids, None)  # (B, T, d)
        else:  # the byte Llama: each id after its own last ids (a tree node: its root path)
            hidden = backbone.embed_windows(ids, self._windows(ids, offsets, inner))
        split, layers = model.split, backbone.num_layers
        positions, seen = self._prepare(self.cache, self.valid, self.lengths, real, offsets, inner)
        if self.slot_ids is not None:
            self.slot_ids.scatter_(1, self.cache.slots, ids)  # type: ignore[arg-type]
        trunk = backbone.run_static(hidden, range(split), positions, self.cache, seen)
        tail = backbone.run_static(trunk, range(split, layers), positions, self.cache, seen)
        self._append(self.cache, self.valid, self.lengths, real)
        return trunk, model.verifier_logits(tail)  # (B, T, d), (B, T, V)

    def _windows(self, ids: Tensor, offsets: Tensor, inner: Tensor) -> Tensor:
        """Each new id's shifted history ``(B, T, m)`` (``m`` = the byte Llama's ``maxlen``;
        j: the id j steps back, + 1; 0 before the row): the new ids it sees at depth
        ``offsets - j`` (a chain's id j before it, a tree node's ancestor), then the row's
        own ids by slot before its length."""
        m = int(self.model.backbone.maxlen)
        want = offsets[:, :, None] - torch.arange(m, device=ids.device)  # (B, T, m) depths
        match = inner[:, :, None, :] & (offsets[:, None, None, :] == want[..., None])  # (B,T,m,T)
        new = (match * (ids[:, None, None, :] + 1)).sum(-1)  # (B, T, m)
        assert self.slot_ids is not None
        at = self.lengths[:, None, None] + want  # (B, T, m) the slot of an id before the pass
        past = self.slot_ids.gather(1, at.clamp(min=0).flatten(1)).view_as(at) + 1
        return torch.where(want >= 0, new, torch.where(at >= 0, past, 0))

    def draft_step(self, hidden: Tensor, real: Tensor, offsets: Tensor, inner: Tensor) -> Tensor:
        """The draft tail (layers split..L-1, the LoRA adapter on: the caller switches it) on
        T kept trunk states per row ``hidden`` ``(B, T, d)``, appended to cache D (``real``,
        ``offsets``, ``inner``: as :meth:`step`). Returns its outputs ``(B, T, d)``."""
        cache, valid, lengths = self.draft_cache, self.draft_valid, self.draft_lengths
        assert cache is not None
        positions, seen = self._prepare(cache, valid, lengths, real, offsets, inner)
        layers = range(self.model.split, self.model.backbone.num_layers)
        out = self.model.backbone.run_static(hidden, layers, positions, cache, seen)
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
        return self._call(self.step, (ids, real, offsets, inner), (self.valid, self.lengths))

    def run_draft(self, hidden: Tensor, real: Tensor, offsets: Tensor, inner: Tensor) -> Tensor:
        """:meth:`draft_step` with the adapter on, compiled (eager after a failure)."""
        self._draft_buffers()
        state = (self.draft_valid, self.draft_lengths)
        with self.model.backbone.adapter(True):
            out: Tensor = self._call(self.draft_step, (hidden, real, offsets, inner), state)
        return out

    def _draft_buffers(self) -> None:
        """Cache D's buffers, allocated on first use."""
        if self.draft_cache is None:
            model = self.model
            self.draft_cache, self.draft_valid, self.draft_lengths = self._buffers(
                model.split, model.backbone.num_layers
            )

    def _call(
        self, eager: Callable[..., Any], args: tuple[Tensor, ...], state: tuple[Tensor, Tensor]
    ) -> Any:
        """``eager(*args)`` compiled (:func:`compile_step`, once per step), or eagerly after a
        failure (``state``: the valid and lengths it updates, restored before the retry)."""
        if self.failed is not None or self.backend is None:  # None: never compiled
            return eager(*args)
        if eager.__name__ not in self.compiled:
            self.compiled[eager.__name__] = compile_step(eager, self.backend, self.device)
        compiled = self.compiled[eager.__name__]
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
    mode = "reduce-overhead" if backend == "inductor" and device.type == "cuda" else None
    return torch.compile(step, fullgraph=True, dynamic=False, backend=backend, mode=mode)
