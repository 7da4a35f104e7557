"""The Python API under bad input (issue 13, items 12 and 14)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mtpc
from mtpc.model import MTPCModel


def _llama(vocab: int, eos: int | list[int] | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    return model


def test_a_generic_llama_is_not_a_byte_model() -> None:
    from mtpc.decoding.common import default_stop_ids

    tiny_vocab = MTPCModel.from_hf(_llama(4, eos=3), kind="cp", window=2, rank=2)
    assert tiny_vocab.backbone.codec is None  # was: the tiny target's codec
    assert default_stop_ids(tiny_vocab) == (3,)  # the model's own eos, as transformers
    res = mtpc.generate(tiny_vocab, [1, 2], max_new_tokens=4)  # was: "stop_ids contains 11"
    assert len(res.tokens) <= 4 and all(0 <= t < 4 for t in res.tokens)

    bpe = MTPCModel.from_hf(_llama(100, eos=[7, 9]), kind="cp", window=2, rank=2)
    assert bpe.backbone.codec is None and default_stop_ids(bpe) == (7, 9)

    byte = MTPCModel.from_hf(_llama(320), kind="cp", window=2, rank=2)
    assert byte.backbone.codec == "tiny"  # a Llama with the byte codec's vocabulary keeps it


@pytest.fixture(scope="module")
def model() -> MTPCModel:
    return MTPCModel.from_hf(_llama(320), kind="cp", window=2, rank=2)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([65.7, 66.0], r"prompt_ids contains 65\.7; allowed: integer token ids"),
        (torch.tensor([65.0, 66.0]), r"prompt_ids is a float32 tensor; allowed: integer"),
    ],
)
def test_float_token_ids_are_refused(model: MTPCModel, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):  # was: silently truncated to ints
        mtpc.generate(model, prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"stop_ids contains 3\.5"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, stop_ids=[3.5])


@pytest.mark.parametrize("greedy", [False, True])
def test_temperature_nan_is_refused(model: MTPCModel, greedy: bool) -> None:
    proposal = None if greedy else "marginal"
    with pytest.raises(ValueError, match=r"temperature=nan is not allowed; allowed: a number > 0"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, greedy=greedy, proposal=proposal,
                      temperature=math.nan)  # fmt: skip
