"""Test-only stand-ins for heterogeneous-vocabulary decoding (the trained fixture drafters
live in :mod:`mtpc.evaluation.fixture_drafters`).

* :func:`char_tokenizer`: a BPE over a handful of symbols with fixed merges (tiny
  vocabularies for enumerated-distribution tests).
* :func:`whitespace_tokenizer`: a character BPE without byte fallback.
* :class:`BigramLM`: a stub causal LM whose next-token logits depend on the last token only
  (a table), so the target's exact distribution is known in closed form.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import PreTrainedTokenizerFast

from mtpc.evaluation.fixture_drafters import EOS


def whitespace_tokenizer(texts: list[str], vocab_size: int = 200) -> PreTrainedTokenizerFast:
    """A character BPE without byte fallback: characters unseen in ``texts`` are dropped."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def char_tokenizer(
    symbols: list[str], merges: list[tuple[str, str]] | None = None, eos: str = EOS
) -> PreTrainedTokenizerFast:
    """id 0 is ``eos``, then ``symbols``, then the merged tokens in order (no pre-tokenizer)."""
    merges = list(merges or [])
    vocab = {eos: 0}
    for s in symbols:
        vocab[s] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


class BigramLM(nn.Module):
    """Stub causal LM: logits(next | ..., x) = table[x]; no KV cache."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)  # (V, V)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        return SimpleNamespace(logits=self.table[input_ids], past_key_values=None)

    def next_probs(self, token: int) -> torch.Tensor:
        return torch.softmax(self.table[token].double(), -1)
