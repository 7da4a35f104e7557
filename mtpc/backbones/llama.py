"""HF Llama family behind the backbone interface: ``LlamaForCausalLM`` (the tiny target) and
Llama-shaped 4.4x remote code (tokenkit's, whose layers return a tuple). One ``DynamicCache``
per component; see docs/BACKBONES.md, "Caches" and "Following transformers"."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from mtpc.backbones.base import (
    Backbone,
    additive_mask,
    causal_mask,
    document_mask,
    hf_source,
    tree_attention_mask,
)
from mtpc.backbones.compat import cache_keyword

_FAST_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")


class LlamaBackbone(Backbone):
    """A ``LlamaForCausalLM``-compatible model (``model.embed_tokens/layers/norm/rotary_emb``,
    ``lm_head``). MTP unembeddings (m * V, d) in EvaByte's layout come from ``extra_mtp`` or
    the model's ``mtp_unembeddings``."""

    def __init__(
        self,
        hf_model: nn.Module,
        name: str = "llama",
        codec: str = "tiny",
        source: dict[str, Any] | None = None,
        extra_mtp: torch.Tensor | None = None,
    ) -> None:
        super().__init__(hf_model, name, codec, source or hf_source(hf_model))
        self.extra_mtp = extra_mtp  # MTP unembeddings kept beside the model
        inner: Any = hf_model.model
        layer_cls = type(inner.layers[0])
        self.cache_kw = cache_keyword(layer_cls)
        params = inspect.signature(layer_cls.forward).parameters
        self._pass_cache_position = "cache_position" in params
        # transformers' own layers (not 4.4x remote code) let fast kernels mask causally
        self.native_layers = layer_cls.__module__.startswith("transformers.models.")

    def stp_unembedding(self) -> torch.Tensor:
        return self.hf_model.lm_head.weight[: self.vocab_size]  # type: ignore[union-attr,index]

    def mtp_unembeddings(self) -> torch.Tensor | None:
        mtp = self.extra_mtp
        mtp = getattr(self.hf_model, "mtp_unembeddings", None) if mtp is None else mtp
        if mtp is None:
            return None
        w: Any = mtp.weight if isinstance(mtp, nn.Module) else mtp
        return w.reshape(-1, self.vocab_size, self.hidden_size)  # (m, V, d)

    def new_native_cache(self, start: int, end: int) -> DynamicCache:
        return DynamicCache()

    supports_tree_mask = True

    def native_crop(self, native: Any, remove: int) -> None:
        native.crop(-remove)

    def native_length(self, native: Any, layer: int) -> int:
        return int(native.get_seq_length(layer))

    def native_compact(self, native: Any, base: int, keep: torch.Tensor) -> None:
        # move only the kept tail down to base.. (kept[i] >= base + i, so the copy is safe);
        # the prefix [0, base) stays in place
        filled, count = _filled(native), keep.numel()
        if not filled:
            return
        kept = base + keep.to(filled[0].keys.device)  # (K,)
        for layer in filled:
            layer.keys[:, :, base : base + count] = layer.keys[:, :, kept]  # (B, H, K, D)
            layer.values[:, :, base : base + count] = layer.values[:, :, kept]
        length = filled[0].keys.shape[-2]
        if length > base + count:
            native.crop(base + count - length)  # transformers takes a negative count here

    supports_batch = True

    def native_take(self, native: Any, rows: torch.Tensor, index: torch.Tensor) -> None:
        for layer in _filled(native):
            i = index.to(layer.keys.device)[:, None, :, None]  # (B', 1, P', 1)
            i = i.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])  # (B', H, P', D)
            rows = rows.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, rows).gather(2, i)
            layer.values = layer.values.index_select(0, rows).gather(2, i)

    def native_pad(self, native: Any, length: int) -> None:
        for layer in _filled(native):
            b, h, p, d = layer.keys.shape
            if length > p:
                zeros = layer.keys.new_zeros(b, h, length - p, d)
                layer.keys = torch.cat([layer.keys, zeros], 2)
                layer.values = torch.cat([layer.values, zeros], 2)

    def native_merge(self, native: Any, other: Any) -> None:
        for layer, add in zip(_filled(native), _filled(other), strict=True):
            layer.keys = torch.cat([layer.keys, add.keys])  # (B + B', H, P, D)
            layer.values = torch.cat([layer.values, add.values])

    def run_static(
        self, hidden: torch.Tensor, layers: range, positions: torch.Tensor, native: Any,
        attend: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Layers ``layers`` on ``hidden`` (B, T, d) over a fixed-capacity cache (``static_step.
        SlotCache``: it writes each new key at its row's slot and returns every slot), ``attend``
        (B, T, S) bool over those S slots: no bookkeeping, no host sync, no LoRA switch (the
        adapter stays as it is, off outside ``Backbone.adapter``), so a compiled step traces it."""
        if not layers:
            return hidden
        return self._run(hidden, layers.start, layers.stop, positions, native, 0, attend=attend)

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
        b, t, _ = hidden.shape
        impl = getattr(self.hf_model.config, "_attn_implementation", None)
        mask: torch.Tensor | None = None  # None: the kernel's own causal mask
        if attend is not None:
            mask = additive_mask(attend, hidden.dtype)[:, None]  # (B, 1, T, P + T)
        elif tree_mask is not None:
            mask = tree_attention_mask(past, tree_mask, hidden.dtype, b)
        elif documents is not None:
            mask = document_mask(documents, hidden.dtype)  # (B, 1, T, T)
        elif not (past == 0 and impl in _FAST_CAUSAL and self.native_layers):
            mask = causal_mask(past, t, hidden.dtype, hidden.device, b)
        cos_sin = self.inner.rotary_emb(hidden, positions)
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "position_ids": positions,
            self.cache_kw: native,
            "use_cache": native is not None,
            "position_embeddings": cos_sin,
        }
        if self._pass_cache_position:
            kwargs["cache_position"] = torch.arange(past, past + t, device=hidden.device)
        for layer in self.layers[start:end]:
            out = layer(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out  # (B, T, d)
        return hidden


def _filled(native: Any) -> list[Any]:
    """The layers of a ``DynamicCache`` that hold keys ``(B, H, P, D)`` (a component's
    cache leaves the layers below its first one empty)."""
    return [
        layer
        for layer in native.layers
        if getattr(layer, "is_initialized", True)
        and getattr(layer, "keys", None) is not None
        and layer.keys.dim() == 4
    ]
