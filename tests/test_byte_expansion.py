"""The byte Llama's input expansion, vectorised: exactly tokenkit's rule, no per-id Python.

``ExpansionLookup`` walks a trie of the expansion table in torch, every position at once. It
must equal the rule (``tests.fakes.torch_expand_input_ids``, written after tokenkit's
``torch_expand_input_ids``, and the project's Python ``expand_input_ids``) on random tables
with nested keys, keys longer than ``maxlen``, an empty key and single-id entries, and on
random histories, for every ``last_n``.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import tests.fakes as fakes
from mtpc.backbones import backbone_from_hf
from mtpc.backbones.llama3_byte import ExpansionLookup, expand_input_ids
from tests.fakes import fake_llama3_byte, torch_expand_input_ids


def random_table(
    rng: random.Random, vocab: int, entries: int, longest: int
) -> tuple[dict[tuple[int, ...], int], set[int]]:
    """Keys of shifted ids (1..vocab) of lengths 1..longest; a few ids map on their own."""
    table: dict[tuple[int, ...], int] = {(): 5}  # an empty key is never matched
    for _ in range(entries):
        key = tuple(rng.randint(1, vocab) for _ in range(rng.randint(1, longest)))
        table[key] = rng.randint(1, 50)
        if rng.random() < 0.5:  # its prefixes (most recent first) too: nested matches
            table[key[: rng.randint(1, len(key))]] = rng.randint(1, 50)
    table[(vocab + 3,)] = 7  # an id beyond every history
    with_own = [k[0] for k in table if len(k) == 1]
    singles = set(rng.sample(with_own, k=min(3, len(with_own))))
    return table, singles


@pytest.mark.parametrize("maxlen", [1, 3, 5])
def test_vectorised_expansion_equals_the_rule(maxlen: int) -> None:
    rng = random.Random(maxlen)
    for trial in range(6):
        vocab = rng.choice([3, 6, 12])
        table = random_table(rng, vocab, entries=rng.randint(1, 60), longest=maxlen + 2)
        lookup = ExpansionLookup(table, maxlen)
        gen = torch.Generator().manual_seed(trial)
        ids = torch.randint(0, vocab, (3, 37), generator=gen)  # shifted: 1..vocab
        for last_n in (None, 1, 4, 37, 100):
            want = torch_expand_input_ids(ids, table, maxlen, last_n)
            assert torch.equal(expand_input_ids(ids, table, maxlen, last_n), want)
            got = lookup(ids, last_n)
            assert got.dtype == ids.dtype and torch.equal(got, want), (trial, last_n)


def test_fake_table_and_a_long_row() -> None:
    """The fake byte Llama's table (every id and pair, singles), an 8192-id row in one call."""
    hf = fake_llama3_byte(1)
    table, maxlen = hf.model.expand_input_ids_dict, hf.config.expand_input_ids_maxlen
    lookup = ExpansionLookup(table, maxlen)
    ids = torch.randint(0, 40, (2, 300))
    assert torch.equal(lookup(ids), torch_expand_input_ids(ids, table, maxlen))
    row = torch.randint(0, 40, (1, 8192))
    start = time.perf_counter()
    got = lookup(row)
    fast = time.perf_counter() - start
    start = time.perf_counter()
    want = expand_input_ids(row, table, maxlen)
    slow = time.perf_counter() - start
    assert torch.equal(got, want)
    assert fast < slow, (fast, slow)  # typically 100x faster


def test_backbone_embed_uses_no_per_id_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training row is expanded by the lookup (never a per-id loop); a decoding step is
    fed only the ids its new positions can see: ``maxlen - 1`` past ids and the new ones."""
    hf = fake_llama3_byte(1)
    backbone = backbone_from_hf(hf)
    ids = torch.randint(0, 40, (2, 64))
    want = backbone.hf_model.model.embed_tokens(ids) + backbone.hf_model.model.expand_embed_tokens(
        torch_expand_input_ids(ids, hf.model.expand_input_ids_dict, 4)
    )  # (2, 64, d) the rule's embedding

    def per_id(*_: object, **__: object) -> torch.Tensor:
        raise AssertionError("the per-id Python expansion ran")

    with monkeypatch.context() as patch:
        patch.setattr(fakes, "torch_expand_input_ids", per_id)
        patch.setattr("mtpc.backbones.llama3_byte.expand_input_ids", per_id)
        full = backbone.embed(ids)  # (2, 64, d)
    torch.testing.assert_close(full, want, rtol=0, atol=0)
    seen: list[tuple[int, ...]] = []
    expand = type(backbone).expand_ids

    def spy(self: object, history: torch.Tensor, last_n: int | None = None) -> torch.Tensor:
        seen.append(tuple(history.shape))
        return expand(self, history, last_n)  # type: ignore[arg-type]

    monkeypatch.setattr(type(backbone), "expand_ids", spy)
    for t in (1, 20):  # a decoding step after 40 ids: the Python rule, then the lookup
        step = backbone.embed(ids[:, 40 : 40 + t], ids[:, :40])
        torch.testing.assert_close(step, full[:, 40 : 40 + t], rtol=0, atol=0)
    assert seen == [(2, t + hf.config.expand_input_ids_maxlen - 1) for t in (1, 20)]


def test_maxlen_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="expand_input_ids_maxlen is 0; allowed"):
        ExpansionLookup(({(1,): 2}, set()), 0)
