"""Importing the MTPC paper's drafts: exact against their convention, refusals in one line.

The checkpoints are written in the paper's key layout by ``tests/paper_checkpoints.py`` (our
code) and evaluated there from their raw tensors (float64); the import must give the same
window log-probabilities and prefix marginals. Against the paper's own code:
``scripts/check_paper_import.py`` (docs/EVALUATION.md, "The paper's drafts").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtpc.errors import MissingFileError
from mtpc.heads import MTPCHead
from mtpc.paper_import import PaperImportError, head_state, import_paper_draft, read_paper_draft
from tests.fakes import tiny_llama
from tests.paper_checkpoints import reference_prefix_log_probs, write_paper_draft

V, D = 11, 6

CASES = [
    ("ff", 8, 1, False),
    ("cp", 8, 3, False),
    ("hmm", 8, 3, False),
    ("btree", 8, 3, False),
    ("btree", 8, 3, True),
    ("cp", 16, 2, False),
    ("hmm", 16, 2, False),
    ("btree", 16, 2, False),
    ("btree", 16, 2, True),
]


def _ours(tmp_path: Path, kind: str, n: int, r: int, reverse: bool) -> tuple[MTPCHead, dict]:
    folder = write_paper_draft(tmp_path / "paper", kind, n, r, V, D, reverse_folds=reverse)
    draft = read_paper_draft(folder)
    head = MTPCHead(kind, n, r, V, D).double()
    head.load_state_dict(head_state(draft, head.structure))
    state = torch.load(folder / "model@1200.pt", weights_only=True)["model_state_dict"]
    return head, state


def _inputs(n: int, B: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(
        0, V, (B, n), generator=g
    )


@pytest.mark.parametrize(("kind", "n", "r", "reverse"), CASES)
def test_imported_head_gives_their_window_and_prefix_log_probs(
    tmp_path: Path, kind: str, n: int, r: int, reverse: bool
) -> None:
    head, state = _ours(tmp_path, kind, n, r, reverse)
    e, x = _inputs(n)
    ref = reference_prefix_log_probs(state, kind, n, e, x)  # (B, n)
    params = head(e)
    ours = head.circuit.prefix_log_prob(params, x)
    assert ours.dtype == torch.float64
    assert (ours - ref).abs().max() <= 1e-9
    assert (head.circuit.log_prob(params, x) - ref[:, -1]).abs().max() <= 1e-9
    assert ref[:, 0].std() > 0.1  # contextual: the features matter


def _breaks(
    head: MTPCHead, state: dict, kind: str, n: int, e: torch.Tensor, x: torch.Tensor
) -> float:
    ref = reference_prefix_log_probs(state, kind, n, e, x)
    with torch.no_grad():
        return float((head.circuit.prefix_log_prob(head(e), x) - ref).abs().max())


@pytest.mark.parametrize(
    ("kind", "n", "r", "reverse"), [("hmm", 8, 3, False), ("btree", 8, 3, True)]
)
def test_the_comparison_catches_broken_converters(
    tmp_path: Path, kind: str, n: int, r: int, reverse: bool
) -> None:
    """Transposed sum weights, inputs not reordered by _scope_idx, folds assumed left to right."""
    head, state = _ours(tmp_path, kind, n, r, reverse)
    e, x = _inputs(n)
    assert _breaks(head, state, kind, n, e, x) <= 1e-9
    draft = read_paper_draft(tmp_path / "paper")
    draft.sums = [w.transpose(1, 2) if w.shape[1] == w.shape[2] else w for w in draft.sums]
    head.load_state_dict(head_state(draft, head.structure))  # a converter transposing sums
    assert _breaks(head, state, kind, n, e, x) > 1e-2
    good = head_state(read_paper_draft(tmp_path / "paper"), head.structure)
    order = state["circuit._circuit._nodes.0._scope_idx"][:, 0]
    head.load_state_dict(
        {**good, "unembedding": good["unembedding"][order]}
    )  # fold f as position f
    assert _breaks(head, state, kind, n, e, x) > 1e-2
    if reverse:  # a converter that assumes cirkit folds left to right
        draft = read_paper_draft(tmp_path / "paper")
        draft.scope_idx = torch.arange(n)
        draft.sum_scopes = [sorted(s, key=min) for s in draft.sum_scopes]
        head.load_state_dict(head_state(draft, head.structure))
        assert _breaks(head, state, kind, n, e, x) > 1e-2


def _merged_features(path: Path, state: dict, alpha: float, ids: torch.Tensor) -> torch.Tensor:
    """Their draft features: LoRA merged into the weights (W + alpha / r B A), final norm."""
    from transformers import LlamaForCausalLM

    merged = LlamaForCausalLM.from_pretrained(path).eval()
    weights = dict(merged.named_parameters())
    with torch.no_grad():
        for key, a in state.items():
            if key.endswith("lora_A.default.weight"):
                b = state[key.replace("lora_A", "lora_B")]
                name = key.removeprefix("lm._lm.base_model.model.").replace(".lora_A.default", "")
                weights[name].add_((alpha / a.shape[0]) * (b.float() @ a.float()))
        return merged.model(ids).last_hidden_state[0, -1]  # (d,)


@pytest.mark.parametrize(
    ("kind", "n", "r", "k"), [("btree", 8, 2, 2), ("hmm", 8, 2, 1), ("cp", 16, 3, 0)]
)
def test_import_with_lora_on_a_tiny_llama_matches_their_merged_model(
    tmp_path: Path, kind: str, n: int, r: int, k: int
) -> None:
    torch.manual_seed(0)
    hf = tiny_llama(4).eval()
    hf.save_pretrained(tmp_path / "target")
    d = hf.config.hidden_size
    folder = write_paper_draft(
        tmp_path / "paper", kind, n, r, 320, d, dtype=torch.float32, hf_model=hf,
        lora_layers=list(range(4 - k, 4)),
    )  # fmt: skip
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(tmp_path / "target").eval()
    out = import_paper_draft(folder, tmp_path / "draft", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["lora"]["layers"] == k and (k == 0 or config["lora"]["alpha"] == 16.0)
    assert (
        config["imported"]["step"] == 1200 and config["imported"]["checkpoint"] == "model@1200.pt"
    )
    assert config["imported"]["paper_config"]["circuit"]["n_token"] == n
    assert len(config["target"]["weights_fingerprint"]) == 64

    from mtpc.model import MTPCModel

    fresh = LlamaForCausalLM.from_pretrained(tmp_path / "target").eval()
    model = MTPCModel.from_pretrained(out, target=fresh)
    state = torch.load(folder / "model@1200.pt", weights_only=True)["model_state_dict"]
    ids = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        e = model(ids).draft_features[0, -1]  # (d,)
        e_ref = _merged_features(tmp_path / "target", state, 16.0, ids)
        assert (e - e_ref).abs().max() < 1e-4
        if k:  # the alpha matters: their 16 is not our default 32
            assert (
                _merged_features(tmp_path / "target", state, 32.0, ids) - e_ref
            ).abs().max() > 1e-2
        x = torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(2))
        ours = model.head.circuit.prefix_log_prob(model.head(e[None]), x)
        ref = reference_prefix_log_probs(state, kind, n, e_ref[None].double(), x)
        assert (ours.double() - ref).abs().max() < 1e-3


def test_bf16_checkpoint_imports_within_bf16_rounding(tmp_path: Path) -> None:
    folder = write_paper_draft(tmp_path / "paper", "btree", 8, 3, V, 64, dtype=torch.bfloat16)
    draft = read_paper_draft(folder)
    assert draft.dtype == torch.bfloat16
    head = MTPCHead("btree", 8, 3, V, 64).to(torch.bfloat16)
    head.load_state_dict(head_state(draft, head.structure))
    state = torch.load(folder / "model@1200.pt", weights_only=True)["model_state_dict"]
    e = torch.randn(4, 64, dtype=torch.float64).bfloat16()
    x = torch.randint(0, V, (4, 8))
    ours = head.circuit.prefix_log_prob(head(e), x).double()
    ref = reference_prefix_log_probs(state, "btree", 8, e.double(), x)
    # logits of magnitude ~3 rounded to bf16 (8 bits): ~0.01 per leaf and sum, n = 8 of each
    assert (ours - ref).abs().max() < 0.2


# ---------------------------------------------------------------------------- refusals ----
def _refused(tmp_path: Path, match: str, *args: object, **kwargs: object) -> None:
    folder = write_paper_draft(tmp_path / "paper", *args, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(PaperImportError, match=match) as err:
        read_paper_draft(folder)
    assert "\n" not in str(err.value)


def test_unknown_head_key_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"mt_head\._norm\.weight.*RMSNorm", "cp", 8, 2, V, D,
             state_over={"mt_head._norm.weight": torch.ones(D)})  # fmt: skip
    _refused(tmp_path, r"mt_head\._sum_weights_heads\.0\.head\.mlp", "cp", 8, 2, V, D,
             state_over={"mt_head._sum_weights_heads.0.head.mlp.0.weight": torch.ones(1)})  # fmt: skip


def test_hmm_with_a_bias_key_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"HMM .*bias", "hmm", 8, 2, V, D,
             state_over={"mt_head._sum_weights_heads.0.head.bias": torch.zeros(1, 2, 2)})  # fmt: skip


def test_identity_initialised_hmm_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"init_hmm_identity=true", "hmm", 8, 2, V, D,
             config_over={"mt_head.hyperparameters.init_hmm_identity": True})  # fmt: skip


def test_repetitions_are_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"circuit\.n_repetition=2", "btree", 8, 2, V, D,
             config_over={"circuit.n_repetition": 2})  # fmt: skip


@pytest.mark.parametrize("n", [5, 6])
def test_btree_off_powers_of_two_is_refused(tmp_path: Path, n: int) -> None:
    _refused(tmp_path, rf"circuit\.n_token={n}", "btree", 8, 2, V, D,
             config_over={"circuit.n_token": n, "circuit.model.n_token": n})  # fmt: skip


def test_mlp_expander_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"expander_type='mlp'", "cp", 8, 2, V, D,
             config_over={"mt_head.hyperparameters.expander_type": "mlp"})  # fmt: skip


def test_stored_lm_weights_are_refused(tmp_path: Path) -> None:
    _refused(tmp_path, r"carries LM weights", "cp", 8, 2, V, D,
             state_over={"lm._lm.model.norm.weight": torch.ones(D)})  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "config_over", "match"),
    [
        ("cp", {"mt_head.hyperparameters.share_sum_weights": True}, r"share_sum_weights=true"),
        ("hmm", {"mt_head.hyperparameters.contextual_hmm_weights": False}, r"contextual_hmm"),
        ("cp", {"mt_head.hyperparameters.transformer_n_layer": 1}, r"transformer_n_layer=1"),
        ("btree", {"circuit.model.kind": "random-btree"}, r"kind='random-btree'"),
    ],
)
def test_other_head_and_circuit_settings_are_refused(
    tmp_path: Path, kind: str, config_over: dict, match: str
) -> None:
    _refused(tmp_path, match, kind, 8, 2, V, D, config_over=config_over)


def test_a_btree_whose_fold_wiring_is_not_stored_is_refused(tmp_path: Path) -> None:
    # n = 8: 6 inner layers, the output entry is 7
    output = "circuit._circuit._address_book._in_fold_idx_7_0"
    _refused(tmp_path, r"address book .* does not describe a BTree", "btree", 8, 2, V, D,
             state_over={output: None})  # fmt: skip


def test_non_finite_weights_are_refused(tmp_path: Path) -> None:
    proj = torch.zeros(8, 2, V, D, dtype=torch.float64)
    proj[3, 1, 0, 0] = float("nan")
    _refused(tmp_path, r"_categorical_log_probs_heads\.0\.head\.proj holds NaN", "cp", 8, 2,
             V, D, state_over={"mt_head._categorical_log_probs_heads.0.head.proj": proj})  # fmt: skip


def test_the_target_is_named_by_the_configs_hub_id(tmp_path: Path) -> None:
    from mtpc.paper_import import _target_name

    def named(lm_id: str, **kwargs: str) -> tuple[str, str | None]:
        folder = write_paper_draft(tmp_path / lm_id.replace("/", "_"), "cp", 8, 2, V, D,
                                   lm_id=lm_id)  # fmt: skip
        return _target_name(read_paper_draft(folder), kwargs.get("model"), kwargs.get("path"))

    assert named("EvaByte/EvaByte-SFT") == ("evabyte", "EvaByte/EvaByte-SFT")
    assert named("x/Llama3-2-3B-IT-Byte") == ("llama3_byte", "x/Llama3-2-3B-IT-Byte")
    assert named("EvaByte/EvaByte-SFT", path="/ckpt") == ("evabyte", "/ckpt")
    assert named("org/other", model="tiny") == ("tiny", None)
    with pytest.raises(PaperImportError, match=r"'org/other' is not a known target; give --model"):
        import_paper_draft(tmp_path / "org_other", tmp_path / "out")  # before any target loads


def test_missing_folder_and_checkpoint_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="does not exist"):
        read_paper_draft(tmp_path / "nowhere")
    folder = write_paper_draft(tmp_path / "paper", "cp", 8, 2, V, D)
    (folder / "model@1200.pt").unlink()
    with pytest.raises(MissingFileError, match=r"no model@<step>\.pt"):
        read_paper_draft(folder)
    (folder / "config.yaml").unlink()
    with pytest.raises(MissingFileError, match=r"config\.yaml does not exist"):
        read_paper_draft(folder)


def test_cli_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mtpc.paper_import import main

    with pytest.raises(SystemExit) as err:
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]


# -------------------------------------------------------------------------- end to end ----
@pytest.mark.slow  # 5 s: the bundled target, one evaluation
def test_eval_runs_on_an_imported_draft_of_the_bundled_tiny_target(tmp_path: Path) -> None:
    """The embedded default: a draft of the bundled target in their format, imported by the
    CLI, evaluated by eval's evaluate(): greedy output equals AR's."""
    from mtpc.backbones import load_backbone
    from mtpc.evaluation.run import evaluate
    from mtpc.paper_import import main
    from tests.helpers import eval_cfg

    hf = load_backbone("tiny").hf_model
    write_paper_draft(
        tmp_path / "paper", "btree", 8, 2, 320, hf.config.hidden_size, dtype=torch.bfloat16,
        hf_model=hf, lora_layers=[3], lm_id="tiny",
    )  # fmt: skip
    out = main([str(tmp_path / "paper"), "--out", str(tmp_path / "draft"), "--model", "tiny"])
    res = evaluate(eval_cfg(tmp_path, draft=[str(out)], num_prompts=2, num_prompt_sets=1))
    rows = res["rows"]
    assert len(rows) == 2 and rows[1]["mu_acc"] >= 1.0


def test_the_last_checkpoint_is_read_unless_a_step_is_given(tmp_path: Path) -> None:
    folder = write_paper_draft(tmp_path / "paper", "cp", 8, 2, V, D, step=100, seed=1)
    write_paper_draft(folder, "cp", 8, 2, V, D, step=1200, seed=2)
    last, first = read_paper_draft(folder), read_paper_draft(folder, step=100)
    assert (last.step, first.step) == (1200, 100)
    assert not torch.equal(last.categorical, first.categorical)
    with pytest.raises(
        PaperImportError, match=r"step=5 has no model@5\.pt .*allowed: \[100, 1200\]"
    ):
        read_paper_draft(folder, step=5)


def test_compiled_model_keys_read_as_plain_ones(tmp_path: Path) -> None:
    folder = write_paper_draft(tmp_path / "paper", "btree", 8, 2, V, D)
    ckpt = torch.load(folder / "model@1200.pt", weights_only=True)
    plain = read_paper_draft(folder)
    ckpt["model_state_dict"] = {f"_orig_mod.{k}": v for k, v in ckpt["model_state_dict"].items()}
    torch.save(ckpt, folder / "model@1200.pt")
    compiled = read_paper_draft(folder)
    assert torch.equal(plain.categorical, compiled.categorical)
    assert compiled.sum_scopes == plain.sum_scopes


def test_a_draft_that_does_not_fit_the_target_is_refused_in_one_line(tmp_path: Path) -> None:
    hf = tiny_llama(4).eval()
    folder = write_paper_draft(tmp_path / "a", "cp", 8, 2, 320, D)  # d = 6, the target's 32
    with pytest.raises(PaperImportError, match=r"V=320, d=6 but the target has V=320, d=32"):
        import_paper_draft(folder, tmp_path / "out", target=hf)
    folder = write_paper_draft(
        tmp_path / "b", "cp", 8, 2, 320, 32, hf_model=hf, lora_layers=[1, 2]
    )  # not the last k layers of 4
    with pytest.raises(PaperImportError, match=r"LoRA on layers \[1, 2\].*\[2, 3\]") as err:
        import_paper_draft(folder, tmp_path / "out", target=hf)
    assert "\n" not in str(err.value)
