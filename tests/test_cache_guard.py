"""The Llama backbone follows the decoder layers' cache keyword and never decodes from a
cache the layers did not fill.

transformers 5.24 renamed the layers' ``past_key_values`` to ``cache``; passed the old
name, the layers swallowed it in ``**kwargs``, greedy decoding crashed inside attention and
sampling silently returned wrong tokens. Here:

* layers that take ``cache`` (5.24+), ``past_key_values`` (5.0-5.23) or ``past_key_value``
  (4.4x remote code, ``tests/fakes.py``) get their cache filled, and decoding is exact;
* a layer whose cache keyword is dropped (named, then never used) is refused with one line
  naming the cache, the backbone class, transformers' version and the keyword, by the
  autoregressive and the speculative decoders, greedy and sampling, before any token;
* a layer that names no cache keyword at all is refused when the model is built.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import mtpc
from mtpc.backbones.compat import CacheInterfaceError, cache_keyword
from mtpc.decoding.hetero import CachedLM
from mtpc.model import MTPCModel

V = 40
PROMPT = [1, 5, 7, 9, 3, 12]
NEW = 16
INSTALLED_KW = cache_keyword(LlamaDecoderLayer)  # what this transformers' layers take


class _Wrapped(nn.Module):
    """A decoder layer behind another signature (the installed layer does the work)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def _call(self, hidden: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        return self.layer(hidden, **{INSTALLED_KW: cache}, **kwargs)


class NewKeywordLayer(_Wrapped):
    """transformers >= 5.24: ``cache``."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):  # fmt: skip
        return self._call(hidden_states, cache, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=use_cache,
                          position_embeddings=position_embeddings, **kwargs)  # fmt: skip


class OldKeywordLayer(_Wrapped):
    """transformers 5.0-5.23: ``past_key_values``."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):  # fmt: skip
        return self._call(hidden_states, past_key_values, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=use_cache,
                          position_embeddings=position_embeddings, **kwargs)  # fmt: skip


class DroppingLayer(_Wrapped):
    """Names ``cache`` but never hands it on: the cache stays empty (a renamed keyword)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):  # fmt: skip
        return self._call(hidden_states, None, attention_mask=attention_mask,
                          position_ids=position_ids, position_embeddings=position_embeddings)  # fmt: skip


class NoKeywordLayer(_Wrapped):
    """Takes no cache keyword: a cache would land in ``**kwargs``."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                position_embeddings=None, **kwargs):  # fmt: skip
        return self._call(hidden_states, None, attention_mask=attention_mask,
                          position_ids=position_ids, position_embeddings=position_embeddings)  # fmt: skip


def _target(layer_cls: type[_Wrapped] | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval().to(torch.float64)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    if layer_cls is not None:
        layers = hf.model.layers
        for i in range(len(layers)):
            layers[i] = layer_cls(layers[i])
    return hf


def _model(layer_cls: type[_Wrapped] | None, kind: str = "cp") -> MTPCModel:
    model = MTPCModel.from_hf(_target(layer_cls), kind=kind, window=4, rank=2, lora_layers=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _reference_greedy(new: int = NEW) -> list[int]:
    """The unwrapped target's own ``generate`` (transformers' own cache path)."""
    out = _target().generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize(
    ("layer_cls", "keyword"),
    [(NewKeywordLayer, "cache"), (OldKeywordLayer, "past_key_values")],
)
def test_layer_keyword_is_followed_and_decoding_is_exact(layer_cls, keyword) -> None:
    model = _model(layer_cls)
    assert model.backbone.cache_kw == keyword
    want = _reference_greedy()
    for method in ("autoregressive", "speculative"):
        res = mtpc.generate(model, PROMPT, NEW, method=method, greedy=True)
        assert res.tokens == want, method
    # the cache holds every position fed: prompt + new tokens (the last one not yet fed)
    trunk = model.backbone.new_cache(0, model.backbone.num_layers)
    hidden = model.backbone.embed(torch.tensor([PROMPT]))
    model.backbone.run_layers(hidden, 0, model.backbone.num_layers, cache=trunk)
    assert trunk.native.get_seq_length(model.backbone.num_layers - 1) == len(PROMPT)


def test_installed_transformers_layers_are_exact() -> None:
    model = _model(None)
    assert model.backbone.cache_kw == INSTALLED_KW
    res = mtpc.generate(model, PROMPT, NEW, method="speculative", greedy=True)
    assert res.tokens == _reference_greedy()


@pytest.mark.parametrize("method", ["autoregressive", "speculative"])
@pytest.mark.parametrize("greedy", [True, False])
def test_dropped_cache_is_refused_in_one_line(method: str, greedy: bool) -> None:
    model = _model(DroppingLayer)
    with pytest.raises(CacheInterfaceError) as info:
        mtpc.generate(model, PROMPT, NEW, method=method, greedy=greedy, seed=3)
    message = str(info.value)
    assert "\n" not in message
    assert "KV cache holds 0 positions" in message and f"fed it {len(PROMPT)}" in message
    assert "LlamaBackbone" in message
    assert f"transformers {transformers.__version__}" in message
    assert "cache keyword 'cache'" in message


def test_renamed_keyword_passed_by_its_old_name_is_refused() -> None:
    """The 5.24 failure itself: the installed layers handed a keyword they do not take."""
    model = _model(None)
    model.backbone.cache_kw = "past_key_value"  # lands in **kwargs and is dropped
    with pytest.raises(CacheInterfaceError, match="cache keyword 'past_key_value'"):
        mtpc.generate(model, PROMPT, NEW, method="speculative", greedy=False)


def test_layer_without_cache_keyword_is_refused_at_load() -> None:
    with pytest.raises(CacheInterfaceError, match=r"NoKeywordLayer\.forward takes none"):
        MTPCModel.from_hf(_target(NoKeywordLayer), kind="ff", window=2, rank=1, lora_layers=0)


def test_cached_lm_follows_keyword_and_guards() -> None:
    """The heterogeneous decoder's target cache: exact logits with the installed keyword,
    refused when the model drops its cache."""
    hf = _target()
    lm = CachedLM(hf)
    seq = [*PROMPT, 4, 8]
    lm.logits(PROMPT)
    got = lm.logits(seq, rows=2)  # reuses the cache for PROMPT
    full = hf(input_ids=torch.tensor([seq])).logits[0, -2:].float()
    torch.testing.assert_close(got, full)

    class Forgetful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _target()

        def forward(self, input_ids, cache=None, use_cache=None, **kwargs):  # fmt: skip
            out = self.inner(input_ids=input_ids, use_cache=True)  # a fresh cache each call
            return out

    lm = CachedLM(Forgetful())
    lm.logits(PROMPT)
    with pytest.raises(CacheInterfaceError, match="Forgetful"):
        lm.logits([*PROMPT, 4], rows=1)
