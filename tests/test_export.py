"""Export -> load round trip, wrong target, circuit mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtpc.export import TargetMismatchError
from mtpc.model import MTPCModel
from tests.fakes import randomize_lora, tiny_llama

V = 320


def _trained(k: int) -> tuple[MTPCModel, torch.nn.Module]:
    torch.manual_seed(1)
    hf = tiny_llama(3)
    model = MTPCModel.from_hf(hf, kind="btree", window=4, rank=2, lora_layers=k, lora_rank=4)
    with torch.no_grad():
        for p in model.head.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    if k:
        randomize_lora(model)
    return model, hf


@pytest.mark.parametrize("k", [0, 2])
def test_round_trip_is_bit_identical(tmp_path: Path, k: int) -> None:
    model, hf = _trained(k)
    model.save_pretrained(tmp_path, metrics={"val_nll": 1.23}, training_config={"lr": 1e-3})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(
        ["README.md", "config.json", "head.safetensors", *(["adapter.safetensors"] if k else [])]
    )
    from safetensors.torch import load_file

    saved = {n for f in tmp_path.glob("*.safetensors") for n in load_file(f)}
    assert saved == set(model.head.state_dict()) | set(model.lora_state_dict())  # never the target
    # a fresh copy of the same target (LoRA cannot be injected twice)
    torch.manual_seed(1)
    fresh = tiny_llama(3)
    fresh.load_state_dict(
        {n.replace(".base_layer", ""): p for n, p in hf.state_dict().items() if "lora_" not in n}
    )
    loaded = MTPCModel.from_pretrained(tmp_path, target=fresh)
    for (n1, p1), (n2, p2) in zip(
        model.head.state_dict().items(), loaded.head.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    assert model.lora_state_dict().keys() == loaded.lora_state_dict().keys()
    for n, p in model.lora_state_dict().items():
        assert "lora_" in n and torch.equal(p, loaded.lora_state_dict()[n])
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        a, b = model(ids, return_verifier_logits=True), loaded(ids, return_verifier_logits=True)
        assert torch.equal(a.draft_features, b.draft_features)
        assert torch.equal(a.verifier_logits, b.verifier_logits)
        x = torch.randint(0, V, (14, 4))
        pa, pb = (
            model.draft_params(model.draft_tail(model.trunk(ids))),
            loaded.draft_params(loaded.draft_tail(loaded.trunk(ids))),
        )
        assert torch.equal(model.head.circuit.log_prob(pa, x), loaded.head.circuit.log_prob(pb, x))
    card = (tmp_path / "README.md").read_text()
    assert "btree" in card and "val_nll" in card
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["circuit"] == {
        "kind": "btree",
        "window": 4,
        "rank": 2,
        "vocab_size": V,
        "hidden_size": 32,
        "dtype": "float32",
        "homogeneous": False,
        "contextual_transitions": True,
        "init": model.head.init_options(),
    }
    assert config["lora"]["layers"] == k and config["codec"] == "tiny"


def test_rebuild_from_local_path(tmp_path: Path) -> None:
    hf = tiny_llama(2)
    hf.save_pretrained(tmp_path / "target")
    hf = type(hf).from_pretrained(tmp_path / "target").eval()
    model = MTPCModel.from_hf(hf, kind="cp", window=2, rank=2)
    model.save_pretrained(tmp_path / "draft")
    loaded = MTPCModel.from_pretrained(tmp_path / "draft")  # rebuilt from name_or_path
    assert loaded.target_fingerprint() == model.target_fingerprint()


def test_wrong_target_fails_naming_both(tmp_path: Path) -> None:
    model, _ = _trained(0)
    model.save_pretrained(tmp_path)
    torch.manual_seed(99)
    other = tiny_llama(3)
    with pytest.raises(
        TargetMismatchError, match=r"exported for target hf .*but the given target is hf "
    ):
        MTPCModel.from_pretrained(tmp_path, target=other)


def test_circuit_mismatch_and_missing_files(tmp_path: Path) -> None:
    model, hf = _trained(0)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["circuit"]["rank"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json circuit \(kind='btree', window=4, rank=3\)"):
        MTPCModel.from_pretrained(tmp_path, target=hf)
    with pytest.raises(ValueError, match="expected an exported MTPC draft folder"):
        MTPCModel.from_pretrained(tmp_path / "nope", target=hf)
    config["circuit"]["rank"] = 2
    config["lora"]["layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"adapter\.safetensors is missing"):
        MTPCModel.from_pretrained(tmp_path, target=tiny_copy(hf))


def tiny_copy(hf: torch.nn.Module) -> torch.nn.Module:
    fresh = tiny_llama(3)
    fresh.load_state_dict(hf.state_dict())
    return fresh


@pytest.mark.parametrize("options", [{"homogeneous": True}, {"contextual_transitions": False}])
def test_hmm_ablations_round_trip(tmp_path: Path, options: dict[str, bool]) -> None:
    """Options that change the parameter shapes are recorded and rebuilt on load."""
    torch.manual_seed(1)
    hf = tiny_llama(3)
    model = MTPCModel.from_hf(hf, kind="hmm", window=3, rank=2, lora_layers=0, **options)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["circuit"]["init"]["sum_init_std"] == model.head.sum_init_std
    loaded = MTPCModel.from_pretrained(tmp_path, target=hf)
    for key, value in model.head.state_dict().items():
        assert torch.equal(loaded.head.state_dict()[key], value), key
