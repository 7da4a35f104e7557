"""One interface for a decoder-only LM split at layer ``L - k`` (:class:`Backbone`, never a
copy of the HF model) and the KV cache of one component (:class:`LayerCache`): trunk = layers
``0..L-k-1``, verifier / draft tail = ``L-k..L-1`` with LoRA off / on (paper Sec. 3.4, App.
D). See docs/BACKBONES.md, "The split" and "Interface"."""

from __future__ import annotations

import contextlib
import copy
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mtpc.backbones.compat import CacheInterfaceError, cache_guard_message
from mtpc.choices import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of ``dtype`` (a :data:`DTYPES` name or a dtype), checked for ``device``.
    Raises ValueError (before any weights are loaded): unknown dtype or device, fp16 on CPU, bf16
    where the device cannot run it, CUDA without a GPU."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        shown = dtype if isinstance(dtype, torch.dtype) else repr(dtype)
        raise ValueError(f"dtype is {shown}; allowed: {sorted(DTYPES)}")
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
    past: int,
    length: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batch: int = 1,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive causal mask (batch, 1, length, past + length) for ``length`` new queries after
    ``past`` cached keys: query i (at ``past + i``) sees key j <= past + i and, with a sliding
    window, only the ``sliding_window`` keys before it."""
    q = torch.arange(length, device=device)[:, None] + past  # (T, 1)
    k = torch.arange(past + length, device=device)[None, :]  # (1, P + T)
    allowed = k <= q
    if sliding_window is not None:
        allowed &= k >= q - sliding_window
    return additive_mask(allowed, dtype)[None, None].expand(batch, 1, length, past + length)


def document_mask(documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask (B, 1, T, T) inside each document of packed rows. ``documents`` (B, T):
    document index per position; padding (negative) attends only to padding, so no row of the mask
    is empty."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()  # (T, T)
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    return additive_mask((same & causal)[:, None], dtype)  # (B, 1, T, T)


def tree_attention_mask(
    past: int, tree_mask: torch.Tensor, dtype: torch.dtype, batch: int = 1
) -> torch.Tensor:
    """Additive mask (batch, 1, T, past + T): cached keys visible, new ones by ``tree_mask``."""
    t = tree_mask.shape[0]
    cached = tree_mask.new_ones(t, past, dtype=torch.bool)  # (T, P)
    allowed = torch.cat([cached, tree_mask.to(torch.bool)], 1)  # (T, P + T)
    return additive_mask(allowed, dtype)[None, None].expand(batch, 1, t, past + t)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed`` (bool, any shape), the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


class LayerCache:
    """The KV cache of one component (layers ``start..end-1``): the native cache, the cached length
    and the id history (the byte Llama's embedding reads it); crop and compact replay nothing."""

    def __init__(self, backbone: Backbone, start: int, end: int) -> None:
        if not 0 <= start <= end <= backbone.num_layers:
            raise ValueError(
                f"layer range is [{start}, {end}); allowed: 0 <= start <= end <= {backbone.num_layers}"
            )
        self.backbone = backbone
        self.start = start
        self.end = end
        self.reset()

    def reset(self) -> None:
        """Empties the cache (a fresh native cache object)."""
        start, end = self.start, self.end
        self.native: Any = self.backbone.new_native_cache(start, end) if end > start else None
        self.length = 0
        self.ids: torch.Tensor | None = None  # (B, length) ids recorded with record_ids

    def __len__(self) -> int:
        return self.length

    def record_ids(self, ids: torch.Tensor) -> None:
        """Appends ``ids`` (B, T) to the id history (done by the component that embeds)."""
        self.ids = ids if self.ids is None else torch.cat([self.ids, ids], dim=1)

    def crop(self, length: int) -> None:
        """Drops every cached position at or after ``length`` (ValueError: out of range, or
        behind what the native cache can still drop: EVA's compressed chunks)."""
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
        ``keep`` (K,): strictly increasing offsets into what was appended after ``base`` (an
        accepted path of a token tree); ValueError otherwise or when ``base`` is out of range."""
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
        return copy.deepcopy(self, {id(self.backbone): self.backbone})


class Backbone(nn.Module, ABC):
    """A decoder-only LM behind one split-at-layer interface: subclasses implement the model's
    pieces, this class the cache bookkeeping and the LoRA switch (``lora``: a ``LoraTail``).
    ``source`` says how to rebuild the target (``{"model", "path", "revision"}``)."""

    needs_history = False
    supports_tree_mask = False
    """``run_layers(..., tree_mask=...)``: T new nodes attend their ancestors in one pass."""
    supports_batch = False
    """``run_layers(..., attend=...)``, ``native_take/pad/merge``: rows at their own lengths
    (``layout.Padded``); EvaByte batches on the static engine (``decoding.static_eva``) instead."""

    def __init__(self, hf_model: nn.Module, name: str, codec: str, source: dict[str, Any]) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.name = name
        self.codec = codec
        self.source = dict(source)
        self.lora: Any = None
        hf_model.requires_grad_(False)

    # --- model-specific pieces (defaults: the HF decoder layout ``hf_model.model.*``) ------
    @property
    def inner(self) -> Any:
        return self.hf_model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.inner.layers

    @property
    def config(self) -> Any:
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
        """Input embeddings of ``ids`` (B, T) -> (B, T, d); ``past_ids`` (B, P) precede them
        (read only by an embedding of the id history: the byte Llama's expansion)."""
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
        """Positions the layers recorded in the native cache for ``layer`` (``None``: the
        backbone keeps the count itself, no guard)."""
        return None

    def native_compact(self, native: Any, base: int, keep: torch.Tensor) -> None:
        """Keeps ``[0, base)``, ``base + keep`` of a native cache (:meth:`LayerCache.compact`)."""
        raise NotImplementedError(f"{type(self).__name__} has no compaction by index")

    def native_take(self, native: Any, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Keeps batch rows ``rows`` (B',) of a native cache and, in row i, the positions
        ``index[i]`` (B', P') in that order (batched decoding: rows leave, holes close)."""
        raise NotImplementedError(f"{type(self).__name__} has no batched cache")

    def native_pad(self, native: Any, length: int) -> None:
        """Appends zero positions (masked out by the caller) to a native cache up to ``length``."""
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
        """Runs layers ``start..end-1`` as :meth:`run_layers` (``native``: None without a cache)."""

    # --- shared machinery ------------------------------------------------------------------
    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm: pre-norm hidden states (..., d) -> features (..., d)."""
        return self.inner.norm(hidden)

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
        """Runs layers ``start..end-1`` on ``hidden`` (B, T, d) -> (B, T, d). ``positions`` (B, T)
        or (T,), default ``cache.length + arange(T)``. A ``cache`` is appended to, without autograd
        (inference); ``None`` is a training run. ``adapter``: LoRA on (draft tail) or off. Only
        without a cache: ``documents`` (B, T) document index of packed rows (negative on padding),
        attention kept inside each where supported. Only with a cache: ``tree_mask`` (T, T) bool,
        new position i attends new position j where True (cached ones always; ``None``: causal;
        ``supports_tree_mask``); ``attend`` (B, T, P + T) bool per row (``supports_batch``)."""
        b, t, _ = hidden.shape
        if tree_mask is not None:
            if cache is None:
                raise ValueError("tree_mask (token-tree verification) needs a cache")
            if not self.supports_tree_mask:
                raise ValueError(f"{type(self).__name__} does not support tree_mask")
            if tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (t, t):
                raise ValueError(
                    f"tree_mask must be a ({t}, {t}) bool tensor, got "
                    f"{tuple(tree_mask.shape)} {tree_mask.dtype}"
                )
            if not bool(tree_mask.diagonal().all()):
                raise ValueError("tree_mask must let every node attend itself (a True diagonal)")
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
            # the component's last layer holds every position fed to it, or the layers dropped
            # the cache (a renamed keyword) and tokens are wrong
            got = None if cache.native is None else self.native_length(cache.native, end - 1)
            if got is not None and got != cache.length:
                message = cache_guard_message(self, self.cache_kw, cache.length, got)
                raise CacheInterfaceError(message)
        return hidden

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """STP logits of the wrapped model's own forward (B, T) -> (B, T, V), adapter off."""
        with self.adapter(False):
            out = self.hf_model(input_ids=ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[..., : self.vocab_size]

    def weights_fingerprint(self, samples: int = 4096) -> str:
        """A cheap sha256 of the frozen weights: names, shapes, dtypes and up to ``samples``
        strided values of every tensor; LoRA weights are left out, so attaching an adapter
        keeps the target's identity."""
        h = hashlib.sha256()
        for name, t in sorted(self.hf_model.state_dict().items()):
            if "lora_" in name:
                continue
            name = name.replace(".base_layer.", ".")
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            sample = flat[::step][:samples].to("cpu", torch.float32).contiguous()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            h.update(sample.numpy().tobytes())
        return h.hexdigest()


def hf_source(hf_model: nn.Module, model: str | None = None) -> dict[str, Any]:
    """The identity of an HF model: its name, name_or_path and commit hash, when known."""
    config: Any = getattr(hf_model, "config", None)
    return {
        "model": model or "hf",
        "path": getattr(config, "_name_or_path", None) or None,
        "revision": getattr(config, "_commit_hash", None),
    }
