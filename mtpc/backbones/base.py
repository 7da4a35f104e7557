"""One interface for a decoder-only LM split at layer ``L - k``.

A :class:`Backbone` wraps a Hugging Face causal LM (never copies it) and exposes the
pieces self-speculative decoding and training need:

* ``embed(ids, past_ids)``: input embeddings; ``past_ids`` is the id history before
  ``ids`` (the byte-level Llama needs it for its expansion embedding; others ignore it).
* ``run_layers(hidden, start, end, positions, cache, adapter, tree_mask)``: layers
  ``start..end-1`` on hidden states, appending to a :class:`LayerCache` when one is given;
  ``adapter`` switches the LoRA draft adapter on (draft tail) or off (trunk, verifier tail);
  ``tree_mask`` lets the new positions attend each other as a token tree.
* ``norm(hidden)``: the final norm; ``stp_logits(features)``: the next-token head.
* ``stp_unembedding()`` (V, d) and ``mtp_unembeddings()`` (m, V, d) or ``None``: what the
  MTPC head is initialised from.

Components (paper Sec. 3.4, App. D): trunk S = layers ``0..L-k-1``; verifier tail V and draft
tail D = layers ``L-k..L-1`` with the adapter off / on. Each component owns a
:class:`LayerCache` made by ``backbone.new_cache(start, end)``.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mtpc.backbones.compat import CacheInterfaceError, cache_guard_message
from mtpc.choices import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Checks that ``dtype`` is one MTPC supports and that ``device`` can run it.

    Args:
        dtype: a name from :data:`DTYPES` or a ``torch.dtype``.
        device: where the model will run.

    Returns:
        The torch dtype.

    Raises:
        ValueError: unknown dtype or device, fp16 on CPU, bf16 on a GPU without bf16, or a
            CUDA device on a machine without one. Raised before any weights are loaded.
    """
    names = {v: k for k, v in DTYPES.items()}
    if isinstance(dtype, torch.dtype):
        if dtype not in names:
            raise ValueError(f"dtype is {dtype}; allowed: {sorted(DTYPES)}")
        name = names[dtype]
    else:
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"dtype is {dtype!r}; allowed: {sorted(DTYPES)}")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device is {str(device)!r}; allowed: 'cpu', 'cuda', 'cuda:<index>'")
    if dev.type == "cpu":
        if name == "float16":
            raise ValueError(
                "dtype is 'float16' on device 'cpu': CPUs have no fast fp16 matmul; "
                "allowed on cpu: ['bfloat16', 'float32']"
            )
        if name == "bfloat16" and not _cpu_runs_bf16():
            raise ValueError(
                "dtype is 'bfloat16' but this CPU cannot run bf16 matmuls; use 'float32'"
            )
    else:
        if not torch.cuda.is_available():
            raise ValueError(f"device is {str(device)!r} but CUDA is not available; allowed: 'cpu'")
        if name == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                "dtype is 'bfloat16' but this GPU has no bf16 support; allowed: ['float16', 'float32']"
            )
    return DTYPES[name]


def _cpu_runs_bf16() -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16)
        return bool(torch.isfinite((a @ a).float()).all())
    except RuntimeError:
        return False


def causal_mask(
    past: int, length: int, dtype: torch.dtype, device: torch.device, batch: int = 1
) -> torch.Tensor:
    """Additive causal mask for ``length`` new queries after ``past`` cached keys.

    Returns:
        (batch, 1, length, past + length): 0 where query i may attend key j (j <= past + i),
        the dtype's minimum elsewhere.
    """
    q = torch.arange(length, device=device)[:, None] + past  # (T, 1)
    k = torch.arange(past + length, device=device)[None, :]  # (1, P + T)
    mask = torch.zeros(length, past + length, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, length, past + length)


def document_mask(documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask that keeps attention inside each document of packed rows.

    Args:
        documents: (B, T) document index per position; padding (negative) attends only to
            padding, so no row of the mask is empty.
        dtype: the attention scores' dtype.

    Returns:
        (B, 1, T, T): 0 where query i may attend key j (j <= i, same document), the dtype's
        minimum elsewhere.
    """
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()  # (T, T)
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    allowed = (same & causal)[:, None]  # (B, 1, T, T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=documents.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_attention_mask(
    past: int, tree_mask: torch.Tensor, dtype: torch.dtype, batch: int = 1
) -> torch.Tensor:
    """Additive mask for T new tree nodes after ``past`` cached keys.

    Args:
        past: cached positions (always visible).
        tree_mask: (T, T) bool, ``[i, j]`` True when node i may attend node j (its ancestors
            and itself).
        dtype: the attention scores' dtype.
        batch: batch size.

    Returns:
        (batch, 1, T, past + T): 0 where allowed, the dtype's minimum elsewhere.
    """
    t = tree_mask.shape[0]
    allowed = torch.cat(
        [tree_mask.new_ones(t, past, dtype=torch.bool), tree_mask.to(torch.bool)], 1
    )  # (T, P + T)
    return additive_mask(allowed, dtype)[None, None].expand(batch, 1, t, past + t)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed`` (bool, any shape), the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def check_tree_mask(tree_mask: torch.Tensor, length: int) -> None:
    """Raises ValueError unless ``tree_mask`` is a (T, T) bool mask with a True diagonal."""
    if tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (length, length):
        raise ValueError(
            f"tree_mask must be a ({length}, {length}) bool tensor, got "
            f"{tuple(tree_mask.shape)} {tree_mask.dtype}"
        )
    if not bool(tree_mask.diagonal().all()):
        raise ValueError("tree_mask must let every node attend itself (a True diagonal)")


class LayerCache:
    """The KV cache of one component (layers ``start..end-1`` of a backbone).

    Wraps the backbone's native cache object. Tracks the number of cached positions and the
    ids that went through the component (the byte-level Llama's embedding needs the whole
    id history). Supports append (through ``Backbone.run_layers``), ``crop`` to a shorter
    length (rejected drafts), ``compact`` (keep an accepted path by index), reuse across
    decoding cycles, ``clone`` and ``reset``. Both act on the native cache by index
    (``Backbone.native_crop`` / ``native_compact``); nothing is replayed.
    """

    def __init__(self, backbone: Backbone, start: int, end: int) -> None:
        if not 0 <= start <= end <= backbone.num_layers:
            raise ValueError(
                f"layer range is [{start}, {end}); allowed: 0 <= start <= end <= {backbone.num_layers}"
            )
        self.backbone = backbone
        self.start = start
        self.end = end
        self.native: Any = backbone.new_native_cache(start, end) if end > start else None
        self.length = 0
        self.ids: torch.Tensor | None = None  # (B, length) ids recorded with record_ids

    def __len__(self) -> int:
        return self.length

    def record_ids(self, ids: torch.Tensor) -> None:
        """Appends ``ids`` (B, T) to the id history (done by the component that embeds)."""
        self.ids = ids if self.ids is None else torch.cat([self.ids, ids], dim=1)

    def crop(self, length: int) -> None:
        """Drops every cached position at or after ``length``.

        Raises:
            ValueError: ``length`` is negative or longer than the cache, or behind what the
                native cache can still drop (EVA: positions compressed into chunk RFAs).
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length is {length}; allowed: 0 <= length <= {self.length}")
        if length == self.length:
            return
        if self.native is not None:
            self.backbone.native_crop(self.native, self.length - length)
        if self.ids is not None:
            self.ids = self.ids[:, :length]
        self.length = length

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keeps positions ``[0, base)`` and then ``base + keep``, in that order; drops the rest.

        Args:
            base: cached positions kept as they are.
            keep: (K,) int64 offsets into what was appended after ``base``, strictly
                increasing (an accepted path of a token tree). ``crop(length)`` is
                ``compact(base, arange(length - base))``.

        Raises:
            ValueError: ``base`` or ``keep`` out of range, or ``keep`` not increasing.
        """
        if not 0 <= base <= self.length:
            raise ValueError(f"compact base is {base}; allowed: 0 <= base <= {self.length}")
        keep = keep.to(torch.long).reshape(-1)
        if keep.numel() and (
            int(keep[0]) < 0
            or int(keep[-1]) >= self.length - base
            or bool((keep.diff() <= 0).any())
        ):
            raise ValueError(
                f"compact keep is {keep.tolist()}; allowed: strictly increasing offsets in "
                f"[0, {self.length - base})"
            )
        if self.native is not None:
            self.backbone.native_compact(self.native, base, keep)
        if self.ids is not None:
            tail = self.ids[:, base:].index_select(1, keep.to(self.ids.device))
            self.ids = torch.cat([self.ids[:, :base], tail], dim=1)
        self.length = base + int(keep.numel())

    def clone(self) -> LayerCache:
        """An independent copy (shares the backbone, copies the cached tensors)."""
        backbone, self.backbone = self.backbone, None  # type: ignore[assignment]
        try:
            new = copy.deepcopy(self)
        finally:
            self.backbone = backbone
        new.backbone = backbone
        return new

    def reset(self) -> None:
        """Empties the cache (a fresh native cache object)."""
        self.native = (
            self.backbone.new_native_cache(self.start, self.end) if self.end > self.start else None
        )
        self.length = 0
        self.ids = None


class Backbone(nn.Module, ABC):
    """A decoder-only LM behind one split-at-layer interface.

    Subclasses implement the model-specific pieces; this class owns the cache bookkeeping
    and the LoRA switch. ``self.hf_model`` is the wrapped model (registered as a submodule,
    so its weights exist once).

    Attributes:
        name: registry name (``tiny``, ``evabyte``, ``llama3_byte``, ``llama``).
        codec: byte codec name (see ``mtpc.backbones.codecs``).
        source: how to rebuild the target (``{"model": name, "path": ..., "revision": ...}``).
        lora: the attached ``LoraTail`` or ``None``.
    """

    needs_history = False
    supports_tree_mask = False
    """``run_layers(..., tree_mask=...)``: T new nodes attend their ancestors in one pass."""
    supports_batch = False
    """``run_layers(..., attend=...)`` and :meth:`native_take`: rows of one batched cache at
    their own lengths (batched decoding, ``mtpc.decoding.layout``)."""

    def __init__(self, hf_model: nn.Module, name: str, codec: str, source: dict[str, Any]) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.name = name
        self.codec = codec
        self.source = dict(source)
        self.lora: Any = None
        for p in hf_model.parameters():
            p.requires_grad_(False)

    # --- model-specific pieces (defaults: the HF decoder layout ``hf_model.model.*``) ------
    @property
    def inner(self) -> Any:
        """The decoder stack (``hf_model.model`` in HF causal LMs)."""
        return self.hf_model.model

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order."""
        return self.inner.layers

    @property
    def final_norm(self) -> nn.Module:
        """The norm applied after the last layer."""
        return self.inner.norm

    @property
    def config(self) -> Any:
        """The wrapped model's config."""
        return self.hf_model.config

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def embed(self, ids: torch.Tensor, past_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings of ``ids`` (B, T) -> (B, T, d); ``past_ids`` (B, P) precede them.

        The default looks ``ids`` up in the input embedding table; models whose embedding
        reads the id history (the byte Llama's expansion) override it.
        """
        return self.inner.embed_tokens(ids)  # (B, T, d)

    @abstractmethod
    def stp_unembedding(self) -> torch.Tensor:
        """The next-token unembedding matrix (V, d)."""

    def mtp_unembeddings(self) -> torch.Tensor | None:
        """Pretrained multi-token unembeddings (m, V, d), ``m`` heads, or ``None``."""
        return None

    @abstractmethod
    def new_native_cache(self, start: int, end: int) -> Any:
        """A fresh native cache object for layers ``start..end-1``."""

    def native_crop(self, native: Any, remove: int) -> None:
        """Removes the last ``remove`` positions from a native cache (if supported)."""
        raise NotImplementedError

    cache_kw = "native"
    """How the native cache is handed to the layers (named by the cache guard's error)."""

    def native_length(self, native: Any, layer: int) -> int | None:
        """Positions the native cache holds for ``layer`` as the layers themselves recorded
        them, or ``None`` where this backbone keeps the count itself (no guard needed)."""
        return None

    def native_compact(self, native: Any, base: int, keep: torch.Tensor) -> None:
        """Keeps positions ``[0, base)`` and ``base + keep`` of a native cache (see
        :meth:`LayerCache.compact`)."""
        raise NotImplementedError(f"{type(self).__name__} has no compaction by index")

    def native_take(self, native: Any, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Keeps batch rows ``rows`` (B',) of a native cache and, in row i, the positions
        ``index[i]`` (B', P') in that order (batched decoding: rows leave, holes close)."""
        raise NotImplementedError(f"{type(self).__name__} has no batched cache")

    def native_pad(self, native: Any, length: int) -> None:
        """Appends zero positions to a native cache up to ``length`` (masked out by the
        caller; batched decoding merges caches of different lengths)."""
        raise NotImplementedError(f"{type(self).__name__} has no batched cache")

    def native_merge(self, native: Any, other: Any) -> None:
        """Appends the rows of ``other`` (same length) to ``native`` along the batch."""
        raise NotImplementedError(f"{type(self).__name__} has no batched cache")

    def one_pass_span(self, length: int, count: int) -> int:
        """How many of ``count`` new positions after ``length`` cached ones one cached pass
        computes exactly (all of them, except where the attention changes form: EVA windows)."""
        return count

    @abstractmethod
    def _run(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        native: Any,
        past: int,
        documents: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs layers ``start..end-1``; ``native`` may be ``None`` (no cache).

        ``documents`` (B, T), only without a cache: attention stays inside each document
        of a packed row where the backbone supports it. ``tree_mask`` (T, T) bool, only with
        a cache and ``supports_tree_mask``: new position i attends the cache and the new
        positions j with ``tree_mask[i, j]``. ``attend`` (B, T, P + T) bool, only with a
        cache and ``supports_batch``: which cached and new positions each new one attends.
        """

    # --- shared machinery ------------------------------------------------------------------
    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm: pre-norm hidden states (..., d) -> features (..., d)."""
        return self.final_norm(hidden)

    def stp_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Next-token logits of normed features (..., d) -> (..., V)."""
        w = self.stp_unembedding()
        return torch.nn.functional.linear(features.to(w.dtype), w)

    def new_cache(self, start: int, end: int) -> LayerCache:
        """A :class:`LayerCache` for one component (layers ``start..end-1``)."""
        return LayerCache(self, start, end)

    @contextlib.contextmanager
    def adapter(self, enabled: bool) -> Iterator[None]:
        """Switches the LoRA draft adapter on or off inside the block (off after it)."""
        if self.lora is None:
            if enabled:
                raise ValueError("adapter=True but no LoRA adapter is attached (lora_layers=0)")
            yield
            return
        self.lora.set_enabled(enabled)
        try:
            yield
        finally:
            self.lora.set_enabled(False)

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        adapter: bool = False,
        documents: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs layers ``start..end-1`` on ``hidden`` (B, T, d) -> (B, T, d).

        Args:
            hidden: hidden states entering layer ``start``.
            start: first layer.
            end: one past the last layer; ``start == end`` returns ``hidden`` unchanged.
            positions: (B, T) or (T,) absolute positions; default ``cache.length + arange(T)``.
            cache: appended to (the new positions follow the cached ones); cached runs are
                inference and run without autograd. ``None`` runs without a cache (training).
            adapter: LoRA adapter on (draft tail) or off (trunk, verifier tail).
            documents: (B, T) document index of each position of packed training rows
                (negative on padding); attention does not cross documents where the
                backbone supports it. Only without a cache.
            tree_mask: (T, T) bool over the new positions: ``tree_mask[i, j]`` is True when
                new position i may attend new position j (its ancestors and itself); every
                cached position is visible. ``None``: the causal chain. Only with a cache;
                ``positions`` then gives each node's cache length + depth.
        """
        b, t, _ = hidden.shape
        if tree_mask is not None:
            if cache is None:
                raise ValueError("tree_mask (token-tree verification) needs a cache")
            if not self.supports_tree_mask:
                raise ValueError(f"{type(self).__name__} does not support tree_mask")
            check_tree_mask(tree_mask, t)
        past = 0 if cache is None else cache.length
        if documents is not None and cache is not None:
            raise ValueError("documents (packed-row attention) is for cache-free training runs")
        if cache is not None and (cache.start, cache.end) != (start, end):
            raise ValueError(
                f"cache covers layers [{cache.start}, {cache.end}) but run_layers got [{start}, {end})"
            )
        if positions is None:
            positions = torch.arange(past, past + t, device=hidden.device)
        if positions.dim() == 1:
            positions = positions[None].expand(b, t)
        if end > start:
            grad = contextlib.nullcontext() if cache is None else torch.no_grad()
            with grad, self.adapter(adapter):
                native = None if cache is None else cache.native
                hidden = self._run(
                    hidden, start, end, positions, native, past, documents, tree_mask, attend
                )
        if cache is not None:
            cache.length += t
            self._guard_cache(cache)
        return hidden

    def _guard_cache(self, cache: LayerCache) -> None:
        """One length comparison: the native cache of the component's last layer must hold
        every position fed to it, or the layers dropped the cache (a renamed keyword) and
        any token computed from it would be wrong.

        Raises:
            CacheInterfaceError: the lengths differ (names the class, transformers, keyword).
        """
        if cache.native is None:
            return
        got = self.native_length(cache.native, cache.end - 1)
        if got is not None and got != cache.length:
            raise CacheInterfaceError(cache_guard_message(self, self.cache_kw, cache.length, got))

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """STP logits of the wrapped model's own forward (B, T) -> (B, T, V), adapter off."""
        with self.adapter(False):
            out = self.hf_model(input_ids=ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[..., : self.vocab_size]

    def weights_fingerprint(self) -> str:
        """A cheap sha256 of the frozen weights (names, shapes, dtypes, strided samples)."""
        return weights_fingerprint(self.hf_model)


def weights_fingerprint(model: nn.Module, samples: int = 4096) -> str:
    """Hashes names, shapes, dtypes and up to ``samples`` strided values of every tensor.

    LoRA weights (names with ``lora_``) are left out, so attaching an adapter does not
    change the target's identity. Costs one pass over a few thousand values per tensor,
    not over the whole model.
    """
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].to("cpu", torch.float32).contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()
