"""EvaByte-SFT (``EvaByte/EvaByte-SFT``, remote code ``evabyte_hf``) behind the backbone interface.

Written against ``evabyte_hf/modeling_evabyte.py`` and ``eva_cache.py`` of
OpenEvaByte/evabyte:

* ``lm_head`` is ``Linear(d, num_pred_heads * V)``; rows ``i*V..(i+1)*V-1`` are MTP head
  ``i`` (head 0 is the next-byte head). They initialise the MTPC head.
* Decoder layers are called as the model's own forward calls them:
  ``layer(h, attention_mask=masks, position_ids=pos, past_key_value=cache, use_cache=True,
  cos=cos, sin=sin, multibyte_decoding=False)``, with ``cos, sin = rotary_emb(h, seq_len)``
  indexed by position, and the mask tuple from the model's
  ``_prepare_eva_generation_attn_mask[_triton]``.
* The cache is the remote ``EvaCache`` (PyTorch EVA) or ``EvaStaticCacheForTriton``. Their
  per-layer lists grow by append and detect prefill by ``len(list) <= layer_idx``, and only
  layer 0 counts seen tokens; a tail cache (layers from ``start > 0``) is therefore padded
  with ``start`` placeholder entries and its token count is advanced here. EVA caches
  cannot crop, so :class:`~mtpc.backbones.base.LayerCache` crops them by snapshot and replay.
  After a prefill, EVA decodes one position per call (its decoding masks assume it), so
  longer appends are fed position by position.
* Without a cache (training forward), a throwaway cache is used, as EvaByte's own
  inference forward does.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from mtpc.backbones.base import Backbone

HUB_ID = "EvaByte/EvaByte-SFT"


class EvaByteBackbone(Backbone):
    """``EvaByteForCausalLM`` (remote code) split at a layer."""

    native_crop_supported = False

    def __init__(
        self, hf_model: nn.Module, source: dict[str, Any] | None = None, cache_batch_size: int = 1
    ) -> None:
        config: Any = hf_model.config
        source = source or {
            "model": "evabyte",
            "path": getattr(config, "_name_or_path", None) or None,
            "revision": getattr(config, "_commit_hash", None),
        }
        super().__init__(hf_model, "evabyte", "evabyte", source)
        self.remote = sys.modules[type(self.inner).__module__]
        self.use_triton = bool(getattr(self.remote, "USE_TRITON_IMPL", False))
        self.num_pred_heads = int(getattr(config, "num_pred_heads", 1) or 1)
        self.cache_batch_size = cache_batch_size

    def _lm_head(self) -> torch.Tensor:
        return self.hf_model.lm_head.weight  # type: ignore[union-attr,return-value]

    def stp_unembedding(self) -> torch.Tensor:
        return self._lm_head()[: self.vocab_size]  # (V, d): head 0

    def mtp_unembeddings(self) -> torch.Tensor | None:
        if self.num_pred_heads <= 1:
            return None
        return self._lm_head().reshape(self.num_pred_heads, self.vocab_size, self.hidden_size)

    def stp_logits(self, features: torch.Tensor) -> torch.Tensor:
        logits = super().stp_logits(features)
        return logits.float() if getattr(self.hf_model.config, "fp32_logits", False) else logits

    def new_native_cache(self, start: int, end: int) -> Any:
        config: Any = self.hf_model.config
        if self.use_triton:
            native = self.remote.EvaStaticCacheForTriton(
                self.cache_batch_size,
                config.num_attention_heads,
                config.window_size,
                config.hidden_size // config.num_attention_heads,
                config.num_hidden_layers,
                self.dtype,
                self.device,
            )
        else:
            native = self.remote.EvaCache()
        for value in vars(native).values():  # per-layer lists that grow by append
            if isinstance(value, list) and not value:
                value.extend([None] * start)
        return native

    def _masks(self, native: Any, batch: int, length: int, device: torch.device) -> Any:
        dummy = torch.zeros(batch, length, dtype=torch.long, device=device)
        if self.use_triton:
            return self.inner._prepare_eva_generation_attn_mask_triton(None, dummy, True, native)
        return self.inner._prepare_eva_generation_attn_mask(None, dummy, True, native)

    def _run(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        native: Any,
        past: int,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # EVA attention builds its own (chunked, causal) masks: packed documents attend
        # across boundaries here; the loss still never uses a window across documents.
        if native is None:
            native = self.new_native_cache(start, end)
        elif past > 0 and hidden.shape[1] > 1:  # EVA decodes one position per call
            steps = [
                self._run(
                    hidden[:, i : i + 1], start, end, positions[:, i : i + 1], native, past + i
                )
                for i in range(hidden.shape[1])
            ]
            return torch.cat(steps, dim=1)
        b, t, _ = hidden.shape
        masks = self._masks(native, b, t, hidden.device)
        if start > 0:  # layer 0 is where EVA counts tokens; a tail cache never sees it
            native._seen_tokens += t
        cos, sin = self.inner.rotary_emb(hidden, seq_len=int(positions.max()) + 1)
        cos = cos[positions].unsqueeze(1)  # (B, 1, T, hd)
        sin = sin[positions].unsqueeze(1)
        for layer in self.layers[start:end]:
            out = layer(
                hidden,
                attention_mask=masks,
                position_ids=positions,
                past_key_value=native,
                output_attentions=False,
                use_cache=True,
                cos=cos,
                sin=sin,
                multibyte_decoding=False,
            )
            hidden = out[0]  # (B, T, d)
        return hidden


def load_evabyte(
    path: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    attention_impl: str = "auto",
) -> EvaByteBackbone:
    """Loads EvaByte-SFT (remote code) from the hub or a local checkpoint and checks it.

    Args:
        path: local checkpoint or hub id (default :data:`HUB_ID`).
        revision: hub revision.
        dtype: the weights' dtype.
        device: where the model runs.
        attention_impl: ``auto`` (triton kernels on a GPU with triton, else the pure-torch
            EVA of ``eva_pt_ref.py``), ``torch`` or ``triton``; the choice is logged.

    Raises:
        TargetLoadError: the checkpoint cannot be loaded or fails the load-time check.
    """
    from mtpc.backbones.compat import load_remote_causal_lm
    from mtpc.backbones.sanity import check_target

    path = path or HUB_ID
    hf_model = load_remote_causal_lm("evabyte", path, revision, dtype, device, attention_impl)
    backbone = EvaByteBackbone(
        hf_model, source={"model": "evabyte", "path": path, "revision": revision}
    )
    check_target(backbone, f"model=evabyte (path={path!r})")
    return backbone
