"""One vocabulary for drafting: ``draft`` and ``proposal`` (docs/DECODING.md, "Drafting")."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mtpc
from mtpc.decoding.settings import CONFIG, SettingsError, check_drafting, check_settings
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
    checked = check_settings(greedy=greedy, **kw)
    rule, proposal = checked.rule_for(kind)
    assert (checked.draft, proposal, rule) == expected


@pytest.mark.parametrize(
    ("greedy", "kw", "message"),
    [
        (True, {"tree_floor": 0.2}, r"tree_floor=0\.2 is not allowed without tree_budget"),
        (True, {"proposal": "path"}, r"proposal='path' is not allowed with greedy=True"),
        (False, {"draft": "map"}, r"draft='map' is not allowed with greedy=False"),
        (False, {"draft": "chain"}, r"draft='chain' is not allowed with greedy=False"),
        (True, {"draft": "tree"}, r"draft='tree' is not allowed without tree_budget"),
        (True, {"draft": "path", "tree_budget": 3}, r"draft='path' is not allowed with tree_b"),
        (False, {"draft": "tree", "tree_budget": 2, "proposal": "path"}, r"with draft=tree"),
        (True, {"draft": "beam"}, r"draft='beam' is not allowed; allowed: path, map, chain, tree"),
        (False, {"proposal": "x"}, r"proposal='x' is not allowed; allowed: path, first_marginal"),
    ],
)
def test_a_setting_another_would_ignore_is_refused(greedy, kw, message) -> None:
    with pytest.raises(SettingsError, match=message):
        check_drafting(greedy, **kw)


@pytest.mark.parametrize(
    ("greedy", "kw", "message"),
    [
        (False, {"draft": "map"}, r"^drafting='map' is not allowed with greedy=false \(its "),
        (
            True,
            {"proposal": "path"},
            r"with greedy=true \(.*allowed: proposal=None, or greedy=false$",
        ),
        (True, {"draft": "path", "tree_budget": 3}, r"^drafting='path' is not allowed with tree_b"),
    ],
)
def test_a_config_refusal_is_spelled_as_the_config_writes_it(greedy, kw, message) -> None:
    """eval.yaml and regenerate.yaml name the chain's draft ``drafting`` and write booleans in
    lower case: the message is made in that spelling, not rewritten afterwards."""
    with pytest.raises(SettingsError, match=message):
        check_drafting(greedy, spell=CONFIG, **kw)


@pytest.fixture(scope="module")
def model() -> MTPCModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return MTPCModel.from_hf(LlamaForCausalLM(config).eval(), kind="cp", window=3, rank=2)


def test_generate_takes_draft_and_proposal(model: MTPCModel) -> None:
    """The names reach the draft step: the rule each choice maps onto decodes."""
    for kw, rule, expected in [
        ({"greedy": False, "proposal": "marginal"}, "sample", ("path", "marginal")),
        ({"greedy": False}, "zsample1", ("path", "first_marginal")),
        ({"greedy": True, "draft": "map"}, "map", ("map", None)),
    ]:
        new = mtpc.generate(model, [65, 66], max_new_tokens=6, seed=3, stop_ids=(), **kw)
        assert new.draft_rule == rule
        assert (new.draft, new.proposal) == expected
    tree = mtpc.generate(model, [65, 66], max_new_tokens=4, tree_budget=3)
    assert tree.draft == "tree" and tree.draft_rule == "tree3"
    with pytest.raises(ValueError, match=r"proposal='path' is not allowed with greedy=True"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, proposal="path")
    with pytest.raises(ValueError, match=r"tree_floor=0\.1 is not allowed without tree_budget"):
        mtpc.generate(model, [65, 66], max_new_tokens=2, tree_floor=0.1)
    with pytest.raises(TypeError, match="draft_mode"):  # the old name is gone, not ignored
        mtpc.generate(model, [65, 66], max_new_tokens=2, draft_mode="map")  # type: ignore[call-arg]


def test_a_tree_without_tree_attention_decodes_its_chain(
    model: MTPCModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backbone without tree attention verifies the chain of the tree's draft rule (exact)."""
    monkeypatch.setattr(model.backbone, "supports_tree_mask", False)
    ar = mtpc.generate(model, [65, 66], max_new_tokens=6, method="autoregressive", stop_ids=())
    with caplog.at_level("WARNING", logger="mtpc.decoding"):
        greedy = mtpc.generate(model, [65, 66], max_new_tokens=6, tree_budget=3, stop_ids=())
    assert (greedy.draft, greedy.proposal, greedy.draft_rule) == ("path", None, "zmap")
    assert greedy.tokens == ar.tokens
    assert "no tree attention; verifying the chain instead" in caplog.text
    sampled = mtpc.generate(model, [65, 66], max_new_tokens=6, tree_budget=3, greedy=False)
    assert (sampled.draft, sampled.proposal, sampled.draft_rule) == (
        "path",
        "first_marginal",
        "zsample1",
    )
