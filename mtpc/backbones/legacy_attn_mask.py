"""``transformers.modeling_attn_mask_utils`` (removed in 5.24) for 4.4x remote code (tokenkit):
the names such code imports, with 4.4x's documented semantics; additive masks (docs/
BACKBONES.md, "Following transformers")."""

from __future__ import annotations

import torch

from mtpc.backbones.base import additive_mask, causal_mask

MODULE_NAME = "transformers.modeling_attn_mask_utils"


def padding_4d(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int | None = None) -> torch.Tensor:
    """A (B, S) 1/0 padding mask as (B, 1, tgt_len, S) additive mask (0 where 1)."""
    b, s = mask.shape
    t = s if tgt_len is None else tgt_len
    return additive_mask(mask[:, None, None, :].to(torch.bool).expand(b, 1, t, s), dtype)


class AttentionMaskConverter:
    """The 4.4x converter: builds 4D additive masks from 2D padding masks."""

    def __init__(self, is_causal: bool, sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window is {sliding_window}; allowed: a positive int")
        self.is_causal = is_causal
        self.sliding_window = sliding_window

    def to_causal_4d(
        self,
        batch_size: int,
        query_length: int,
        key_value_length: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor | None:
        if not self.is_causal:
            raise ValueError("to_causal_4d needs is_causal=True")
        if query_length == 1 and self.sliding_window is None:
            return None
        past = key_value_length - query_length
        return causal_mask(past, query_length, dtype, device, batch_size, self.sliding_window)

    def to_4d(
        self,
        attention_mask_2d: torch.Tensor,
        query_length: int,
        dtype: torch.dtype,
        key_value_length: int | None = None,
    ) -> torch.Tensor:
        b = attention_mask_2d.shape[0]
        out = padding_4d(attention_mask_2d, dtype, query_length)  # (B, 1, T, S)
        if self.is_causal and (query_length > 1 or self.sliding_window is not None):
            if key_value_length is None:
                raise ValueError("to_4d of a causal mask needs key_value_length")
            past = key_value_length - query_length
            device = attention_mask_2d.device
            causal = causal_mask(past, query_length, dtype, device, b, self.sliding_window)
            out = torch.minimum(out, causal)  # additive masks: blocked where either blocks
        return out

    @staticmethod
    def _make_causal_mask(
        input_ids_shape: torch.Size | tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        past_key_values_length: int = 0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        b, t = input_ids_shape
        return causal_mask(past_key_values_length, t, dtype, device, b, sliding_window)

    _expand_mask = staticmethod(padding_4d)

    @staticmethod
    def _unmask_unattended(expanded_mask: torch.Tensor, min_dtype: float) -> torch.Tensor:
        """Rows that attend nothing (every key at ``min_dtype``) attend everything instead
        (SDPA's memory-efficient kernel returns NaN on empty rows; their outputs are unused)."""
        if expanded_mask.dtype == torch.bool:
            raise ValueError("_unmask_unattended expects an additive float mask, got a bool mask")
        empty = (expanded_mask == min_dtype).all(dim=-1, keepdim=True)
        return expanded_mask.masked_fill(empty, 0.0)

    @staticmethod
    def _ignore_causal_mask_sdpa(
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor,
        past_key_values_length: int,
        sliding_window: int | None = None,
        is_training: bool = False,
    ) -> bool:
        """Whether SDPA's own ``is_causal`` can replace the mask: nothing is padded and the
        queries are one token or the whole sequence (then its causal mask is the right one)."""
        query_length = inputs_embeds.shape[1]
        key_value_length = query_length + past_key_values_length
        if sliding_window is not None and key_value_length >= sliding_window:
            return False
        whole_or_one = query_length == 1 or key_value_length == query_length
        if attention_mask is None:
            return whole_or_one
        if attention_mask.dim() == 4:
            return False
        return whole_or_one and bool((attention_mask == 1).all())


def _prepare_4d_causal_attention_mask(
    attention_mask: torch.Tensor | None,
    input_shape: torch.Size | tuple[int, int],
    inputs_embeds: torch.Tensor,
    past_key_values_length: int,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """(B, 1, T, P + T) additive mask from a (B, P + T) padding mask (or none) for T queries."""
    b, t = input_shape[0], input_shape[-1]
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    causal = causal_mask(past_key_values_length, t, dtype, device, b, sliding_window)
    if attention_mask is None:
        return causal
    if attention_mask.dim() == 4:
        return attention_mask
    return torch.minimum(causal, padding_4d(attention_mask, dtype, t))  # blocked where either is


_prepare_4d_attention_mask = padding_4d  # no causal part

# the 4.4x SDPA variants built the same masks (they only returned None more often)
_prepare_4d_causal_attention_mask_for_sdpa = _prepare_4d_causal_attention_mask
_prepare_4d_attention_mask_for_sdpa = _prepare_4d_attention_mask
