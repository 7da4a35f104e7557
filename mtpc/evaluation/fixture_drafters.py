"""The fixture drafters: tiny models with genuinely different tokenizers, trained at first
use on the synthetic chat corpus, for heterogeneous-vocabulary decoding without a hub
(``drafter.model=fixture:bpe|lower|byte_small``, ``scripts/bench_hetero.py``, the tests).
The models are trained briefly, so that drafts are sometimes accepted.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mtpc.backbones.codecs import get_codec
from mtpc.data.synthetic import generate_rows

EOS = "<|endoftext|>"


def corpus(num_rows: int = 400, seed: int = 0, chat: bool = False) -> list[str]:
    """Conversations from the synthetic chat rows: ``"role: content"`` lines, or (``chat``)
    the tiny target's chat template without its special tokens (what a drafter sees)."""
    codec = get_codec("tiny")
    rows = generate_rows(num_rows, seed)
    if chat:
        return [codec.decode(codec.apply_chat_template(r["messages"]).ids) for r in rows]
    return ["".join(f"{m['role']}: {m['content']}\n" for m in r["messages"]) for r in rows]


def bpe_tokenizer(
    texts: list[str], vocab_size: int = 400, normalize: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` (every byte is expressible); ``normalize=True``
    adds NFKC + lowercasing, a non-injective tokenizer (decode(encode(s)) != s)."""
    tok = Tokenizer(models.BPE())
    if normalize:
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def tiny_llama(
    vocab_size: int, seed: int = 0, hidden: int = 48, layers: int = 2
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=2 * hidden,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def train_lm(
    model: LlamaForCausalLM,
    sequences: list[list[int]],
    steps: int = 150,
    seq_len: int = 96,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Next-token training on random windows of the concatenated sequences."""
    stream = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # (B, T)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def encode_corpus(tok: Any, texts: list[str]) -> list[list[int]]:
    """Ids of every text (HF tokenizer or byte codec) followed by its end token."""
    if hasattr(tok, "backend_tokenizer"):
        return [[*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts]
    return [[*tok.encode(t), tok.eos_id] for t in texts]


@cache
def trained_models(
    steps: int = 100, num_rows: int = 200, bpe_vocab: int = 400, chat: bool = False
) -> dict[str, Any]:
    """Briefly trained tiny models sharing the synthetic corpus (built once per process): a
    byte-level target (``byte_lm``), a smaller same-vocabulary drafter (``byte_small``), BPE
    and NFKC + lowercase BPE tokenizers with their models, the codec and the texts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest on a shared CPU
    try:
        texts = corpus(num_rows, chat=chat)
        codec = get_codec("tiny")
        bpe = bpe_tokenizer(texts, bpe_vocab)
        lower = bpe_tokenizer(texts, bpe_vocab, normalize=True)
        byte_ids = encode_corpus(codec, texts)
        lower_ids = encode_corpus(lower, [t.lower() for t in texts])
        return {
            "codec": codec,
            "byte_lm": train_lm(tiny_llama(codec.vocab_size, 0, 64), byte_ids, steps),
            "byte_small": train_lm(tiny_llama(codec.vocab_size, 3, 32, 1), byte_ids, steps, seed=3),
            "bpe": bpe,
            "bpe_lm": train_lm(tiny_llama(len(bpe), 1), encode_corpus(bpe, texts), steps, seed=1),
            "lower": lower,
            "lower_lm": train_lm(tiny_llama(len(lower), 2), lower_ids, steps, seed=2),
            "texts": texts,
        }
    finally:
        torch.set_num_threads(threads)
