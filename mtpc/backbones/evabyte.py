"""EvaByte-SFT (remote code ``evabyte_hf`` of OpenEvaByte/evabyte @ 432331ad) as a backbone.

``lm_head`` rows ``i*V..(i+1)*V-1`` are MTP head ``i`` (head 0: the next byte). Every cached
run is one multibyte pass per EVA window (:class:`EvaWindowCache`, kept by index); cache-free
runs take the model's own prefill path. See docs/BACKBONES.md, "EvaByte: one pass per cycle".
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from mtpc.backbones.base import Backbone, hf_source
from mtpc.backbones.evabyte_kernels import kernels_path
from mtpc.backbones.remote_code import load_remote_causal_lm

HUB_ID = "EvaByte/EvaByte-SFT"
MASK_MIN = -10e10  # eva_pt_ref.MASK_MIN_VALUE
TREE_ROOM = 256  # window-buffer slots beyond W for a pass's new positions (as multi_byte_generate)
_NO_SLOTS = torch.zeros(0, dtype=torch.long)  # keep nothing past base (a crop, a settle)


class EvaWindowCache:
    """EVA decoding state of layers ``layers`` of one row (the remote ``EvaStaticCacheForTriton``
    layout; many rows run on the static engine): window buffers (1, h, W + room, hd) of the
    current window's rotated keys/values, of which ``past_window_pos[l]`` are kept, and the
    earlier windows' chunk RFAs (1, h, C, hd) (``None`` before the first is full).
    ``committed`` positions are kept; ``length - committed`` more were written by the last pass
    and await ``_select`` (keep by index)."""

    def __init__(self, layers: range, backbone: EvaByteBackbone) -> None:
        n, heads = layers.stop, int(backbone.config.num_attention_heads)
        self.layers, self.window = layers, backbone.window_size
        self.past_window_k: list[Any] = [None] * n  # per global layer (None outside layers)
        self.past_window_v: list[Any] = [None] * n
        self.rfa_k: list[Any] = [None] * n
        self.rfa_v: list[Any] = [None] * n
        shape = (1, heads, self.window + TREE_ROOM, backbone.hidden_size // heads)
        for i in layers:
            self.past_window_k[i] = torch.zeros(shape, dtype=backbone.dtype, device=backbone.device)
            self.past_window_v[i] = torch.zeros(shape, dtype=backbone.dtype, device=backbone.device)
        self.past_window_pos: list[Any] = [0] * n
        self.committed = 0
        self.length = 0

    @property
    def window_start(self) -> int:
        """First position of the current window (positions before it are compressed)."""
        return self.committed - self.committed % self.window

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_chunk_rfas(self, layer_idx: int) -> tuple[Any, Any]:
        return self.rfa_k[layer_idx], self.rfa_v[layer_idx]

    def chunks(self) -> int:
        """Number of RFA chunks (the same in every layer)."""
        rfa = self.rfa_k[self.layers.start]
        return 0 if rfa is None else int(rfa.shape[-2])


def multibyte_mask(
    native: EvaWindowCache, batch: int, tree_mask: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The bool mask of one pass (B, 1, T, C + pos + T) over ``[RFAs | kept | new]``: all True,
    ``tree_mask`` among the new (``multi_byte_pred_update_attn_mask``'s layout)."""
    t, pos, chunks = tree_mask.shape[0], native.committed - native.window_start, native.chunks()
    mask = torch.ones(batch, 1, t, chunks + pos + t, dtype=torch.bool, device=device)
    mask[..., chunks + pos :] = tree_mask
    return mask


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotated_qkv(
    attn: Any, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries and keys (rotated by ``cos``/``sin``) and values (B, h, T, hd) of
    ``hidden`` (B, T, d)."""
    assert cos is not None and sin is not None
    b, t, _ = hidden.shape
    h, hd = attn.num_heads, attn.head_dim
    q = attn.q_proj(hidden).view(b, t, h, hd).transpose(1, 2)  # (B, h, T, hd)
    k = attn.k_proj(hidden).view(b, t, h, hd).transpose(1, 2)
    v = attn.v_proj(hidden).view(b, t, h, hd).transpose(1, 2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def multibyte_attention(
    attn: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_value: Any = None,
    output_attentions: bool = False,
    use_cache: bool = False,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    multibyte_decoding: bool = False,
) -> tuple[torch.Tensor, None, Any]:
    """Pure-torch ``EvaAttention._multibyte_decoding_forward`` (eva.py) with eva_pt_ref's math.

    Writes the new keys/values after the kept window positions without keeping them.
    ``attention_mask`` (B, 1, T, C + pos + T) bool over ``[RFAs | window | new]``.
    """
    assert use_cache and multibyte_decoding and attention_mask is not None
    t = hidden_states.shape[1]
    q, k, v = _rotated_qkv(attn, hidden_states, cos, sin)  # (B, h, T, hd) each
    layer, cache = attn.layer_idx, past_key_value
    pos = cache.past_window_pos[layer]
    cache.past_window_k[layer][:, :, pos : pos + t] = k
    cache.past_window_v[layer][:, :, pos : pos + t] = v
    keys = _cat(cache.rfa_k[layer], cache.past_window_k[layer][:, :, : pos + t], -2)
    values = _cat(cache.rfa_v[layer], cache.past_window_v[layer][:, :, : pos + t], -2)
    return _attend(attn, q, keys, values, attention_mask, sdpa=False), None, cache  # C + pos + T


def _attend(
    attn: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
    sdpa: bool,
) -> torch.Tensor:  # fmt: skip
    """``q`` (B, h, T, hd) over ``keys``/``values`` (B, h, S, hd) where the bool ``mask``
    (B, 1, T, S) allows, through ``o_proj`` -> (B, T, d): the remote triton path's math
    (``sdpa``: its ``_multibyte_decoding_forward``) or eva_pt_ref's (:func:`_eva_attend`)."""
    if sdpa:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=False, dropout_p=0.0,
            scale=attn.head_dim_scaling,
        )  # fmt: skip
    else:
        out = _eva_attend(attn, q, keys, values, mask)
    return attn.o_proj(out.transpose(1, 2).flatten(2))  # (B, T, d)


def _eva_attend(
    attn: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """eva_pt_ref's softmax attention of ``q`` (B, h, T, hd) over ``keys``/``values`` (B, h,
    S, hd) where the bool ``mask`` (B, 1, T, S) allows -> (B, h, T, hd)."""
    scores = _fp32_if_mixed(attn, torch.matmul(q, keys.transpose(-2, -1)))  # (B, h, T, S)
    scores = (scores * attn.head_dim_scaling).masked_fill(~mask, MASK_MIN)
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)  # (B, h, T, hd)


def _fp32_if_mixed(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 where the config asks ``mixedp_attn`` (eva_pt_ref's softmax inputs)."""
    return x.float() if getattr(attn.config, "mixedp_attn", False) else x


def _cat(first: torch.Tensor | None, then: Any, dim: int) -> Any:
    """``first`` and ``then`` joined along ``dim`` (``then`` alone where ``first`` is None)."""
    return then if first is None else torch.cat([first, then], dim)


def compress_window(
    attn: Any, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk RFAs (B, h, W / c, hd) of one full window's keys/values ``k``, ``v`` (B, h, W, hd):
    eva_pt_ref's ``_generate_feature_map`` + ``_calculate_chunk_rfa_cache`` (what
    ``triton_eva_prep_kv_fwd`` computes with no mask)."""
    b, h, w, hd = k.shape
    c = attn.chunk_size
    return chunk_rfas(attn, k.reshape(b, h, w // c, c, hd), v.reshape(b, h, w // c, c, hd))


def chunk_rfas(
    attn: Any, rf_k: torch.Tensor, rf_v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RFAs (B, h, n, hd) of n chunks of keys/values ``rf_k``, ``rf_v`` (B, h, n, c, hd),
    each chunk on its own (:func:`compress_window`'s math, any n)."""
    dtype = rf_k.dtype
    mu_logits = torch.sum(attn.adaptive_mu_k.to(dtype) * rf_k, dim=-1, keepdim=True)
    mu = torch.softmax(_fp32_if_mixed(attn, mu_logits), dim=-2).to(dtype)
    rfa_k = torch.sum(mu * rf_k, dim=-2)
    proj = torch.sum(attn.adaptive_phi.to(dtype) * rf_k, dim=-1, keepdim=True)
    norm = torch.sum(rf_k**2, dim=-1, keepdim=True) * 0.5
    log_phi = attn.head_dim_scaling * (_fp32_if_mixed(attn, proj) - _fp32_if_mixed(attn, norm))
    rfa_v = torch.sum(torch.softmax(log_phi, dim=-2).to(dtype) * rf_v, dim=-2)
    return rfa_k, rfa_v


def refresh_rfas(
    attn: Any, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, read: torch.Tensor,
    write: torch.Tensor,
) -> None:  # fmt: skip
    """Recomputes in place, in one layer's buffers ``keys``, ``values`` (B, h, S, hd), the
    RFAs of n chunks of the rows ``rows`` (R, 1): from the slots ``read`` (R, n c) of their
    positions into the slots ``write`` (R, n)."""
    r, n = write.shape
    h, hd, c = keys.shape[1], keys.shape[3], attn.chunk_size
    rf_k = keys[rows, :, read].transpose(1, 2).reshape(r, h, n, c, hd)  # (R, h, n, c, hd)
    rf_v = values[rows, :, read].transpose(1, 2).reshape(r, h, n, c, hd)
    rfa_k, rfa_v = chunk_rfas(attn, rf_k, rf_v)  # (R, h, n, hd)
    keys[rows, :, write] = rfa_k.transpose(1, 2).to(keys.dtype)  # (R, n, h, hd)
    values[rows, :, write] = rfa_v.transpose(1, 2).to(values.dtype)


def static_attention(
    attn: Any,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: Any,
    mask: torch.Tensor,
    sdpa: bool,
) -> torch.Tensor:
    """EVA attention of one layer on ``hidden`` (B, T, d) over fixed buffers (the static
    engine's ``mtpc.decoding.static_eva.EvaSlots``: per layer ONE key and one value buffer
    (B, h, S, hd), the chunk RFAs in its first slots, the window ring and the scratch after):
    writes the new keys/values at ``cache.slots``, recomputes the RFAs of the chunks the pass
    touches (``cache.chunk_read`` -> ``cache.chunk_write``) from the buffer, then attends over
    every slot where ``mask`` (B, 1, T, S) allows. Fixed shapes, no host sync -> (B, T, d)."""
    q, k, v = _rotated_qkv(attn, hidden, cos, sin)  # (B, h, T, hd) each
    i = attn.layer_idx - cache.first
    keys, values = cache.keys[i], cache.values[i]  # (B, h, S, hd)
    rows = cache.rows[:, None]  # (B, 1)
    keys[rows, :, cache.slots] = k.transpose(1, 2).to(keys.dtype)  # (B, T, h, hd): in place
    values[rows, :, cache.slots] = v.transpose(1, 2).to(values.dtype)
    refresh_rfas(attn, keys, values, rows, cache.chunk_read, cache.chunk_write)
    return _attend(attn, q, keys, values, mask, sdpa)  # (B, T, d)


class EvaByteBackbone(Backbone):
    """``EvaByteForCausalLM`` (remote code) split at a layer."""

    supports_tree_mask = True
    supports_batch = True
    """Batches run on the static engine (``mtpc.decoding.static_eva``; without ``compile=``
    uncompiled), not by ``attend`` / ``native_take``: each row has its own EVA window."""

    def __init__(self, hf_model: nn.Module, source: dict[str, Any] | None = None) -> None:
        config: Any = hf_model.config
        super().__init__(hf_model, "evabyte", "evabyte", source or hf_source(hf_model, "evabyte"))
        self.remote = sys.modules[type(self.inner).__module__]
        self.use_triton = bool(getattr(self.remote, "USE_TRITON_IMPL", False))
        kernels = getattr(self.remote, "__mtpc_kernels__", None)
        self.attention_path = kernels_path(kernels) if self.use_triton else "torch (eva_pt_ref.py)"
        """The EVA attention path the layers run (reported by scripts/check_gpu.py)."""
        self.num_pred_heads = int(getattr(config, "num_pred_heads", 1) or 1)
        self.window_size = int(config.window_size)

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

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """STP logits of the remote model's own forward, in eval mode: in training mode it takes
        the cache-free path, where ``eva_pt_ref.py`` (since 4d019e0) raises UnboundLocalError."""
        modes = [(module, module.training) for module in self.hf_model.modules()]
        self.hf_model.eval()
        try:
            return super().reference_logits(ids)
        finally:
            for module, training in modes:
                module.training = training

    def one_pass_span(self, length: int, count: int) -> int:
        """Up to the end of the current EVA window (``multi_byte_generate``'s trim)."""
        return min(count, self.window_size - length % self.window_size)

    # --- caches --------------------------------------------------------------------------------
    def new_native_cache(self, start: int, end: int) -> EvaWindowCache:
        return EvaWindowCache(range(start, end), self)

    def _remote_cache(self, start: int, batch: int) -> Any:
        """A throwaway remote cache (the model's own prefill path) for layers from ``start``,
        sized for the ``batch`` rows of the run (the triton cache's buffers are per row)."""
        config: Any = self.config
        if self.use_triton:
            native = self.remote.EvaStaticCacheForTriton(
                batch, config.num_attention_heads, self.window_size + TREE_ROOM,
                config.hidden_size // config.num_attention_heads, config.num_hidden_layers,
                self.dtype, self.device,
            )  # fmt: skip
        else:
            native = self.remote.EvaCache()
        for value in vars(native).values():  # per-layer lists that grow by append
            if isinstance(value, list) and not value:
                value.extend([None] * start)
        return native

    def _compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any]:
        attn: Any = self.layers[layer].self_attn
        if self.use_triton:
            return self.remote.triton_eva_prep_kv_fwd(
                k, v, attn.adaptive_mu_k, attn.adaptive_phi, None, attn.head_dim_scaling,
                attn.chunk_size,
            )  # fmt: skip
        return compress_window(attn, k, v)

    def _select(self, native: EvaWindowCache, base: int, keep: torch.Tensor) -> None:
        """Keeps window slots ``[0, base)`` in place, moves slots ``keep`` (offsets from the
        window start, increasing, each >= ``base``) to ``base, base + 1, ...``, drops the rest
        and compresses a full window into RFAs (``multi_byte_pred_update_cache``).

        Only moved slots are written: none for a chain's accepted prefix (``keep[i] == base +
        i``, skipped when ``keep`` is on the host; a device ``keep`` moves as it is, no sync).
        """
        w, start, m = self.window_size, native.window_start, int(keep.numel())
        count = base + m
        if count > w:
            raise ValueError(f"cannot keep {count} positions in an EVA window of {w}")
        if m and keep.device.type == "cpu":  # the identity prefix stays where it is
            same = keep == torch.arange(base, count)  # (m,)
            skip = m if bool(same.all()) else int(same.long().cumprod(0).sum())
            base, keep = base + skip, keep[skip:]
        moves = keep.to(native.past_window_k[native.layers.start].device) if keep.numel() else None
        for layer in native.layers:
            k, v = native.past_window_k[layer], native.past_window_v[layer]  # (B, h, W + room, hd)
            if moves is not None:
                k[:, :, base:count] = k[:, :, moves]  # advanced indexing copies first
                v[:, :, base:count] = v[:, :, moves]
            native.past_window_pos[layer] = count
            if count == w:
                rfa_k, rfa_v = self._compress(layer, k[:, :, :w].clone(), v[:, :, :w].clone())
                native.rfa_k[layer] = _cat(native.rfa_k[layer], rfa_k, -2)
                native.rfa_v[layer] = _cat(native.rfa_v[layer], rfa_v, -2)
                native.past_window_pos[layer] = 0
        native.committed = native.length = start + count

    def _settle(self, native: EvaWindowCache) -> None:
        """Keeps every position the last pass wrote (no crop followed it): no slot moves."""
        if native.length > native.committed:
            self._select(native, native.length - native.window_start, _NO_SLOTS)

    def native_compact(self, native: EvaWindowCache, base: int, keep: torch.Tensor) -> None:
        start = native.window_start
        if base < start:
            raise ValueError(
                f"compact base is {base}, but positions before {start} are compressed into EVA's "
                f"chunk RFAs; allowed: {start} <= base <= {native.length}"
            )
        self._select(native, base - start, keep.to(torch.long) + (base - start))

    def native_crop(self, native: EvaWindowCache, remove: int) -> None:
        self.native_compact(native, native.length - remove, _NO_SLOTS)

    # --- the static engine (mtpc.decoding.static_eva) ---------------------------------------
    def run_static(
        self, hidden: torch.Tensor, layers: range, positions: torch.Tensor, native: Any,
        attend: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Layers ``layers`` on ``hidden`` (B, T, d) over the static engine's fixed buffers
        (``mtpc.decoding.static_eva.EvaSlots``; :func:`static_attention`), ``attend`` (B, T,
        S) bool over their S slots: no bookkeeping, no host sync, no branch on the data, so a
        compiled step traces it whole. The layers' own norms, projections, MLPs and rotary
        table; the decoder layer's residual order (``EvaByteDecoderLayer.forward``)."""
        table = native.rotary  # (N, hd) cos and sin, from the remote rotary_emb
        cos, sin = table.cos[positions].unsqueeze(1), table.sin[positions].unsqueeze(1)
        mask = attend[:, None]  # (B, 1, T, S)
        skip_fp32 = bool(getattr(self.config, "fp32_skip_add", False))
        for i in layers:
            layer: Any = self.layers[i]
            residual = hidden.float() if skip_fp32 else hidden
            out = static_attention(
                layer.self_attn, layer.input_layernorm(hidden), cos, sin, native, mask,
                self.use_triton,
            )  # fmt: skip
            hidden = (residual + out).to(out.dtype)
            residual = hidden.float() if skip_fp32 else hidden
            out = layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = (residual + out).to(out.dtype)  # (B, T, d)
        return hidden

    def rotary_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The remote rotary table's cos, sin (length, hd) of positions ``[0, length)`` (what
        :meth:`_rotary` indexes), in the backbone's dtype."""
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, seq_len=length)
        return cos[:length], sin[:length]

    # --- layers --------------------------------------------------------------------------------
    def _pass(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        native: EvaWindowCache,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """One multibyte pass of layers ``start..end-1`` over T new positions (B, T, d)."""
        b, t, _ = hidden.shape
        pos = native.committed - native.window_start
        if pos + t > self.window_size + TREE_ROOM:
            raise ValueError(
                f"{t} new positions after {pos} in the EVA window; allowed: at most "
                f"{self.window_size + TREE_ROOM - pos}"
            )
        mask = multibyte_mask(native, b, tree_mask, hidden.device)
        ours = None if self.use_triton else multibyte_attention
        hidden = self._layers(hidden, start, end, positions, native, mask, attention=ours)
        native.length += t
        return hidden

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[Any, Any]:
        """The remote rotary table's rows at ``positions`` (B, T): cos, sin (B, 1, T, hd)."""
        cos, sin = self.inner.rotary_emb(hidden, seq_len=int(positions.max()) + 1)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def _layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        cache: Any,
        masks: Any,
        attention: Any = None,
    ) -> torch.Tensor:
        """Layers ``start..end-1`` called as the remote model calls them -> (B, T, d): a
        multibyte pass on our caches, the model's own prefill on a remote one. Their attention
        runs ``attention`` (called with the attention module first) where given."""
        cos, sin = self._rotary(hidden, positions)
        layers = self.layers[start:end]
        attns: list[Any] = [] if attention is None else [layer.self_attn for layer in layers]
        for attn in attns:
            attn.forward = functools.partial(attention, attn)
        try:
            for layer in layers:
                hidden = layer(
                    hidden,
                    attention_mask=masks,
                    position_ids=positions,
                    past_key_value=cache,
                    output_attentions=False,
                    use_cache=True,
                    cos=cos,
                    sin=sin,
                    multibyte_decoding=isinstance(cache, EvaWindowCache),
                )[0]  # (B, T, d)
        finally:
            for attn in attns:
                del attn.forward
        return hidden

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
        attend: torch.Tensor | None = None,  # never: EVA's window cache is not batched
    ) -> torch.Tensor:
        # EVA attention builds its own (chunked, causal) masks: packed documents attend
        # across boundaries here; the loss still never uses a window across documents.
        if native is None:
            remote = self._remote_cache(start, hidden.shape[0])  # hidden: (B, T, d)
            return self._run_remote(hidden, start, end, positions, remote)
        self._settle(native)
        t = hidden.shape[1]
        if tree_mask is not None:
            span = self.one_pass_span(native.length, t)
            if int(positions.max()) >= native.window_start + self.window_size:
                raise ValueError(
                    f"a token tree reaches position {int(positions.max())}, past the EVA window "
                    f"ending at {native.window_start + self.window_size}; trim it to depth "
                    f"one_pass_span = {span}"
                )
            return self._pass(hidden, start, end, positions, native, tree_mask)
        if native.length == 0 and self.use_triton:  # the remote prefill writes into our buffers
            remote = self._remote_cache(start, hidden.shape[0])
            remote.past_window_k, remote.past_window_v = native.past_window_k, native.past_window_v
            hidden = self._run_remote(hidden, start, end, positions, remote)
            for layer in native.layers:
                native.past_window_pos[layer] = remote.past_window_pos[layer]
                if len(remote.rfa_k) > layer:
                    native.rfa_k[layer] = remote.rfa_k[layer]
                    native.rfa_v[layer] = remote.rfa_v[layer]
            fill = native.past_window_pos[native.layers.start]  # 1..W: the last window's positions
            native.committed, native.length = t - fill, t  # committed: the last window's start
            self._settle(native)  # a full last window is compressed now
            return hidden
        pieces, i = [], 0
        while i < t:  # a causal run is cut at window boundaries (each piece: one pass)
            self._settle(native)
            take = self.one_pass_span(native.length, t - i)
            chain = torch.ones(take, take, dtype=torch.bool, device=hidden.device).tril()
            piece = hidden[:, i : i + take]
            pieces.append(self._pass(piece, start, end, positions[:, i : i + take], native, chain))
            i += take
        return torch.cat(pieces, dim=1)

    def _run_remote(
        self, hidden: torch.Tensor, start: int, end: int, positions: torch.Tensor, remote: Any
    ) -> torch.Tensor:
        """The model's own prefill path on a remote cache (its masks, its attention)."""
        b, t, _ = hidden.shape
        dummy = torch.zeros(b, t, dtype=torch.long, device=hidden.device)
        if self.use_triton:
            masks = self.inner._prepare_eva_generation_attn_mask_triton(None, dummy, True, remote)
        else:
            masks = self.inner._prepare_eva_generation_attn_mask(None, dummy, True, remote)
        if start > 0:  # layer 0 is where EVA counts tokens; a tail cache never sees it
            remote._seen_tokens += t
        return self._layers(hidden, start, end, positions, remote, masks)


def load_evabyte(
    path: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    attention_impl: str = "auto",
    run_device: str | None = None,
) -> EvaByteBackbone:
    """Loads EvaByte-SFT (remote code, default :data:`HUB_ID`) and checks it (TargetLoadError).

    The attention path is chosen for ``run_device`` (default ``device``); a triton-path model
    loaded on the CPU is moved there for the load-time check and back (its kernels need a GPU).
    """
    from mtpc.backbones.sanity import check_target

    path = path or HUB_ID
    hf_model = load_remote_causal_lm(
        "evabyte", path, revision, dtype, device, attention_impl, run_device=run_device
    )
    source = {"model": "evabyte", "path": path, "revision": revision}
    backbone = EvaByteBackbone(hf_model, source=source)
    moved = backbone.use_triton and torch.device(device).type != "cuda" and run_device is not None
    if moved:
        hf_model.to(run_device)
    try:
        check_target(backbone, f"model=evabyte (path={path!r})")
    finally:
        if moved:
            hf_model.to(device)
            torch.cuda.empty_cache()
    return backbone
