"""Backbone interface: split-at-k equivalence, caches (append / crop / clone), LoRA, adapters."""

from __future__ import annotations

import pytest
import torch

from mtpc.backbones import backbone_from_hf, load_backbone, resolve_dtype
from mtpc.model import MTPCModel
from tests.fakes import fake_evabyte, fake_llama3_byte, randomize_lora, tiny_llama

V = 320  # tiny_llama's and the fake EvaByte's vocabulary

MAKERS = {
    "llama": (tiny_llama, V),
    "evabyte": (fake_evabyte, V),
    "llama3_byte": (fake_llama3_byte, 40),
}


@pytest.mark.parametrize("arch", list(MAKERS))
@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_split_equals_unsplit_and_adapter_only_changes_draft(arch: str, k: int) -> None:
    make, vocab = MAKERS[arch]
    hf = make(4)
    ids = torch.randint(0, vocab, (2, 11))
    ref = hf(input_ids=ids).logits
    model = MTPCModel.from_hf(hf, kind="cp", window=4, rank=2, lora_layers=k)
    trunk = model.trunk(ids)
    verifier = model.verifier_tail(trunk)
    torch.testing.assert_close(model.verifier_logits(verifier), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.draft_tail(trunk), verifier, rtol=0, atol=0)  # B = 0 at init
    if k == 0:
        return
    randomize_lora(model)
    draft = model.draft_tail(trunk)
    assert (draft - verifier).abs().max() > 1e-3
    torch.testing.assert_close(model.verifier_tail(trunk), verifier, rtol=0, atol=0)
    torch.testing.assert_close(model.trunk(ids), trunk, rtol=0, atol=0)
    # the wrapped model itself still computes the target (adapter off outside the draft tail)
    torch.testing.assert_close(hf(input_ids=ids).logits, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", list(MAKERS))
@pytest.mark.parametrize("k", [0, 2])
def test_incremental_with_crop_equals_recompute(arch: str, k: int) -> None:
    """Prefill, then cycles that append drafts and crop the rejected ones (S, V and D)."""
    make, vocab = MAKERS[arch]
    model = MTPCModel.from_hf(make(4), kind="cp", window=4, rank=2, lora_layers=k)
    if k:
        randomize_lora(model)
    ids = torch.randint(0, vocab, (1, 14))
    full_trunk = model.trunk(ids)
    full_v, full_d = model.verifier_tail(full_trunk), model.draft_tail(full_trunk)
    caches = model.new_caches()
    h = model.trunk(ids[:, :5], caches.trunk)
    model.verifier_tail(h, caches.verifier)
    model.draft_tail(h, caches.draft)
    pos = 5
    for accepted in (2, 0, 3):  # one cycle: 4 candidates appended, `accepted` + 1 kept
        junk = torch.randint(0, vocab, (1, 4))
        cand = torch.cat([ids[:, pos : pos + accepted + 1], junk[:, : 3 - accepted]], 1)
        h = model.trunk(cand, caches.trunk)
        v = model.verifier_tail(h, caches.verifier)
        d = model.draft_tail(h, caches.draft)
        keep = accepted + 1
        torch.testing.assert_close(v[:, :keep], full_v[:, pos : pos + keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(d[:, :keep], full_d[:, pos : pos + keep], rtol=0, atol=1e-5)
        caches.crop(pos + keep)
        pos += keep
        assert [len(c) for c in caches] == [pos] * 3
        assert torch.equal(caches.trunk.ids, ids[:, :pos])
    # clone is independent; reset empties
    copy = caches.clone()
    h = model.trunk(ids[:, pos : pos + 1], caches.trunk)
    torch.testing.assert_close(
        model.verifier_tail(h, caches.verifier), full_v[:, pos : pos + 1], rtol=0, atol=1e-5
    )
    assert len(copy.trunk) == pos and len(caches.trunk) == pos + 1
    caches.reset()
    assert [len(c) for c in caches] == [0, 0, 0]


def test_byte_llama_expansion_needs_full_history() -> None:
    hf = fake_llama3_byte(2)
    backbone = backbone_from_hf(hf)
    assert backbone.needs_history and backbone.name == "llama3_byte"
    ids = torch.tensor([[3, 7, 11, 2, 8, 13, 4, 9]])
    changed = ids.clone()
    changed[0, 2] = 12  # an early id
    e, e2 = backbone.embed(ids), backbone.embed(changed)
    torch.testing.assert_close(e[:, :2], e2[:, :2], rtol=0, atol=0)
    assert (e[:, 3] - e2[:, 3]).abs().max() > 0  # the next position sees the change
    # embedding the tail with its history equals embedding it inside the full sequence
    torch.testing.assert_close(backbone.embed(ids[:, 5:], ids[:, :5]), e[:, 5:], rtol=0, atol=0)
    assert (backbone.embed(ids[:, 5:]) - e[:, 5:]).abs().max() > 0  # without history it differs


def test_byte_llama_fallback_expansion_matches_remote() -> None:
    from mtpc.backbones.llama3_byte import expand_input_ids
    from tests.fakes import torch_expand_input_ids

    hf = fake_llama3_byte(1)
    table = hf.model.expand_input_ids_dict
    ids = torch.randint(0, 40, (2, 30))
    for last_n in (None, 7):
        assert torch.equal(
            expand_input_ids(ids, table, 4, last_n), torch_expand_input_ids(ids, table, 4, last_n)
        )


def test_evabyte_lm_head_split_and_stp() -> None:
    hf = fake_evabyte(2)
    backbone = backbone_from_hf(hf)
    mtp = backbone.mtp_unembeddings()
    assert mtp.shape == (8, V, 32)
    w = hf.lm_head.weight
    for i in range(8):
        assert torch.equal(mtp[i], w[i * V : (i + 1) * V])
    assert torch.equal(backbone.stp_unembedding(), w[:V])


def test_llama_family_without_mtp_uses_stp_and_given_mtp() -> None:
    hf = tiny_llama(2)
    assert backbone_from_hf(hf).mtp_unembeddings() is None
    extra = torch.randn(8 * V, 32)
    assert torch.equal(backbone_from_hf(hf, extra).mtp_unembeddings()[3], extra[3 * V : 4 * V])


def test_only_head_and_lora_are_trainable() -> None:
    model = MTPCModel.from_hf(
        tiny_llama(4), kind="cp", window=4, rank=2, lora_layers=2, lora_rank=4
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("head.") or "lora_" in n for n in trainable)
    lora_layers = {int(n.split("layers.")[1].split(".")[0]) for n in trainable if "lora_" in n}
    assert lora_layers == {2, 3}
    out = model(torch.randint(0, V, (2, 9)), return_verifier_logits=True)
    assert out.draft_features.shape == (2, 9, 32) and out.verifier_logits.shape == (2, 9, V)
    params = model.head(out.draft_features.reshape(-1, 32))
    x = torch.randint(0, V, (18, 4))
    model.head.circuit.log_prob(params, x).sum().backward()
    assert all(p.grad is not None for p in model.backbone.lora.parameters())
    assert all(
        p.grad is None for n, p in model.backbone.hf_model.named_parameters() if "lora_" not in n
    )


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"lora.layers \(k\) is 5; allowed: 0..4"):
        MTPCModel.from_hf(tiny_llama(4), kind="cp", window=4, rank=2, lora_layers=5)
    with pytest.raises(
        ValueError, match=r"lora.target_modules \['qkv'\] do not exist.*allowed: \["
    ):
        MTPCModel.from_hf(
            tiny_llama(4), kind="cp", window=4, rank=2, lora_layers=1, lora_target_modules=["qkv"]
        )
    with pytest.raises(ValueError, match="dtype is 'float16' on device 'cpu'"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match=r"dtype is 'float64'; allowed"):
        resolve_dtype("float64")
    with pytest.raises(ValueError, match=r"model.name is .gpt2.; allowed"):
        load_backbone("gpt2")
    with pytest.raises(ValueError, match="dtype is 'float16' on device 'cpu'"):
        load_backbone("evabyte", dtype="float16")  # before any download
    with pytest.raises(ValueError, match="head_init is 'x'"):
        MTPCModel.from_hf(tiny_llama(2), kind="cp", window=4, rank=2, head_init="x")
    with pytest.raises(ValueError, match="expected a Hugging Face causal LM"):
        MTPCModel.from_hf(object(), kind="cp", window=4, rank=2)
    hf = tiny_llama(2)
    MTPCModel.from_hf(hf, kind="cp", window=2, rank=2, lora_layers=1)
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        MTPCModel.from_hf(hf, kind="cp", window=2, rank=2, lora_layers=1)
