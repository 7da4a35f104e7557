"""Our ``transformers.modeling_attn_mask_utils`` (removed in 5.24) behaves as the 4.4x module.

Expected masks are built position by position here (query i at ``past + i`` may attend key j
when ``j <= past + i``, within a sliding window, and not a padded key), so a shim that
returned any mask, or always let SDPA mask by itself, fails.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mtpc.backbones import legacy_attn_mask as shim
from mtpc.backbones.compat import install_removed_module_shims

MIN = torch.finfo(torch.float32).min


def expected(
    batch: int, length: int, past: int, window: int | None = None, keys: list[int] | None = None
) -> torch.Tensor:
    """(batch, 1, length, past + length): 0 where allowed, MIN elsewhere; ``keys`` (P + T,)
    1 / 0 padding of every key (one row for the whole batch)."""
    out = torch.full((batch, 1, length, past + length), MIN)
    for i in range(length):
        q = past + i
        for j in range(past + length):
            ok = j <= q and (window is None or j >= q - window) and (keys is None or keys[j] == 1)
            if ok:
                out[:, 0, i, j] = 0.0
    return out


@pytest.mark.parametrize(("length", "past", "window"), [(4, 0, None), (3, 2, None), (5, 3, 2)])
def test_causal_masks(length: int, past: int, window: int | None) -> None:
    got = shim.AttentionMaskConverter._make_causal_mask(
        (2, length), torch.float32, "cpu", past_key_values_length=past, sliding_window=window
    )
    torch.testing.assert_close(got, expected(2, length, past, window), rtol=0, atol=0)
    converter = shim.AttentionMaskConverter(is_causal=True, sliding_window=window)
    got = converter.to_causal_4d(2, length, past + length, torch.float32)
    torch.testing.assert_close(got, expected(2, length, past, window), rtol=0, atol=0)


def test_one_query_needs_no_causal_mask_and_padding_is_masked() -> None:
    assert shim.AttentionMaskConverter(True).to_causal_4d(1, 1, 5, torch.float32) is None
    keys = [0, 1, 1, 0, 1]
    padding = torch.tensor([keys])
    got = shim.AttentionMaskConverter._expand_mask(padding, torch.float32, tgt_len=2)
    want = torch.tensor([0.0 if k else MIN for k in keys]).expand(1, 1, 2, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # causal + padding, from a 2D mask: the 4.4x model-level helper and the converter
    embeds = torch.zeros(1, 3, 8)
    got = shim._prepare_4d_causal_attention_mask(padding, (1, 3), embeds, past_key_values_length=2)
    torch.testing.assert_close(got, expected(1, 3, 2, keys=keys), rtol=0, atol=0)
    got = shim.AttentionMaskConverter(True).to_4d(padding, 3, torch.float32, key_value_length=5)
    torch.testing.assert_close(got, expected(1, 3, 2, keys=keys), rtol=0, atol=0)
    assert shim._prepare_4d_causal_attention_mask(None, (1, 3), embeds, 0).shape == (1, 1, 3, 3)


def test_unmask_unattended_opens_only_empty_rows() -> None:
    mask = expected(1, 3, 0, keys=[0, 0, 1])  # rows 0 and 1 attend nothing
    got = shim.AttentionMaskConverter._unmask_unattended(mask, MIN)
    assert bool((got[0, 0, :2] == 0).all())  # empty rows attend everything
    torch.testing.assert_close(got[0, 0, 2], mask[0, 0, 2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="bool mask"):
        shim.AttentionMaskConverter._unmask_unattended(mask == 0, MIN)


@pytest.mark.parametrize(
    ("mask", "length", "past", "window", "ignore"),
    [
        (None, 4, 0, None, True),  # the whole sequence: SDPA's is_causal is right
        (None, 1, 6, None, True),  # one query: causal = bidirectional
        (None, 3, 2, None, False),  # queries after a cache: is_causal would be wrong
        (torch.ones(1, 4), 4, 0, None, True),
        (torch.tensor([[0, 1, 1, 1]]), 4, 0, None, False),  # padding needs the mask
        (torch.ones(1, 1, 4, 4), 4, 0, None, False),  # a 4D mask is used as it is
        (None, 4, 0, 3, False),  # the sliding window is reached
    ],
)
def test_ignore_causal_mask_sdpa(mask, length, past, window, ignore) -> None:
    embeds = torch.zeros(1, length, 8)
    got = shim.AttentionMaskConverter._ignore_causal_mask_sdpa(mask, embeds, past, window)
    assert got is ignore


def test_shim_serves_the_removed_module_only(monkeypatch: pytest.MonkeyPatch) -> None:
    name = shim.MODULE_NAME
    present = types.ModuleType(name)  # a transformers that still ships the module
    monkeypatch.setitem(sys.modules, name, present)
    assert install_removed_module_shims() == []
    assert sys.modules[name] is present
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(
        "importlib.import_module",
        _missing(name, __import__("importlib").import_module),
    )
    assert install_removed_module_shims() == [name]
    assert sys.modules[name] is shim
    from transformers.modeling_attn_mask_utils import AttentionMaskConverter

    assert AttentionMaskConverter is shim.AttentionMaskConverter


def _missing(name: str, real):
    def import_module(module: str, *args, **kwargs):
        if module == name:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return real(module, *args, **kwargs)

    return import_module
