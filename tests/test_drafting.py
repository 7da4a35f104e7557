"""One vocabulary for drafting: ``draft`` and ``proposal`` (docs/DECODING.md, "Drafting")."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mtpc
from mtpc.decoding import settings
from mtpc.decoding.settings import SettingsError, resolve_drafting
from mtpc.model import MTPCModel


@pytest.mark.parametrize(
    ("kind", "greedy", "kw", "expected"),
    [
        ("cp", True, {}, ("path", None, "zmap")),
        ("ff", True, {}, ("path", None, "zmap")),
        ("ff", False, {}, ("path", "path", "zsample")),
        ("cp", False, {}, ("path", "first_marginal", "zsample1")),
        ("hmm", False, {}, ("path", "first_marginal", "zsample1")),
        ("btree", False, {}, ("path", "first_marginal", "zsample1")),
        ("cp", True, {"draft": "map"}, ("map", None, "map")),
        ("cp", True, {"draft": "chain"}, ("chain", None, "chain")),
        ("cp", False, {"proposal": "marginal"}, ("path", "marginal", "sample")),
        ("cp", False, {"proposal": "path"}, ("path", "path", "zsample")),
        ("cp", True, {"tree_budget": 4}, ("tree", None, "zmap")),
        ("cp", False, {"draft": "tree", "tree_budget": 4}, ("tree", None, "zsample1")),
    ],
)
def test_choices_map_onto_the_draft_step(kind, greedy, kw, expected) -> None:
    got = resolve_drafting(kind, greedy, **kw)
    assert (got.draft, got.proposal, got.mode) == expected


@pytest.mark.parametrize(
    ("greedy", "kw", "message"),
    [
        (True, {"tree_floor": 0.2}, r"tree_floor=0\.2 is not allowed without tree_budget"),
        (True, {"proposal": "path"}, r"proposal='path' is not allowed with greedy=True"),
        (False, {"draft": "map"}, r"draft='map' is not allowed with greedy=False"),
        (False, {"draft": "chain"}, r"draft='chain' is not allowed with greedy=False"),
        (True, {"draft": "tree"}, r"draft='tree' is not allowed without tree_budget"),
        (True, {"draft": "path", "tree_budget": 3}, r"draft='path' is not allowed with tree_b"),
        (True, {"draft_mode": "map", "draft": "map"}, r"draft_mode='map' is not allowed with dr"),
        (False, {"draft_mode": "zsample", "proposal": "path"}, r"not allowed with draft or pro"),
        (True, {"draft_mode": "zmap", "tree_budget": 2}, r"draft_mode='zmap' is not allowed wi"),
        (False, {"draft_mode": "zmap"}, r"draft_mode='zmap' is not allowed with greedy=False"),
        (False, {"draft": "tree", "tree_budget": 2, "proposal": "path"}, r"with draft=tree"),
        (True, {"draft": "beam"}, r"draft='beam' is not allowed; allowed: path, map, chain, tree"),
        (False, {"proposal": "x"}, r"proposal='x' is not allowed; allowed: path, first_marginal"),
        (True, {"draft_mode": "x"}, r"draft_mode='x' is not allowed; allowed: sample, map"),
    ],
)
def test_a_setting_another_would_ignore_is_refused(greedy, kw, message) -> None:
    with pytest.raises(SettingsError, match=message):
        resolve_drafting("cp", greedy, **kw)


@pytest.mark.parametrize(
    ("mode", "greedy", "note", "expected"),
    [
        (
            "zsample1",
            False,
            "draft_mode=zsample1 is draft=path proposal=first_marginal",
            "zsample1",
        ),
        ("zsample", False, "draft_mode=zsample is draft=path proposal=path", "zsample"),
        ("sample", False, "draft_mode=sample is draft=path proposal=marginal", "sample"),
        ("zmap", True, "draft_mode=zmap is draft=path;", "zmap"),
        ("map", True, "draft_mode=map is draft=map;", "map"),
        ("chain", True, "draft_mode=chain is draft=chain;", "chain"),
        ("zsample", True, "draft_mode=zsample with greedy=True drafts a drawn latent", "zsample"),
    ],
)
def test_old_names_keep_working_with_a_note(mode, greedy, note, expected, caplog) -> None:
    settings._NOTED.clear()
    with caplog.at_level(logging.WARNING, logger="mtpc.decoding.settings"):
        got = resolve_drafting("btree", greedy, draft_mode=mode)
        resolve_drafting("btree", greedy, draft_mode=mode)  # noted once, not per prompt
    assert got.mode == expected
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(note), lines


@pytest.fixture(scope="module")
def model() -> MTPCModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return MTPCModel.from_hf(LlamaForCausalLM(config).eval(), kind="cp", window=3, rank=2)


def test_generate_takes_draft_and_proposal(model: MTPCModel) -> None:
    """The new names reach the draft step: the same mode, the same tokens as the old name."""
    for kw, old, expected in [
        ({"greedy": False, "proposal": "marginal"}, "sample", ("path", "marginal")),
        ({"greedy": False}, "zsample1", ("path", "first_marginal")),
        ({"greedy": True, "draft": "map"}, "map", ("map", None)),
    ]:
        new = mtpc.generate(model, [65, 66], max_new_tokens=6, seed=3, stop_ids=(), **kw)
        was = mtpc.generate(
            model, [65, 66], max_new_tokens=6, seed=3, stop_ids=(), greedy=kw["greedy"],
            draft_mode=old,
        )  # fmt: skip
        assert new.draft_mode == was.draft_mode == old
        assert (new.draft, new.proposal) == expected
        assert new.tokens == was.tokens
    tree = mtpc.generate(model, [65, 66], max_new_tokens=4, tree_budget=3)
    assert tree.draft == "tree" and tree.draft_mode == "tree3"
    with pytest.raises(ValueError, match=r"proposal='path' is not allowed with greedy=True"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, proposal="path")
    with pytest.raises(ValueError, match=r"tree_floor=0\.1 is not allowed without tree_budget"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, tree_floor=0.1)
