"""MTPCModel: head initialisation from EvaByte-layout MTP unembeddings (CP == FF at step 0)."""

from __future__ import annotations

import pytest
import torch

from mtpc.model import MTPCModel
from tests.fakes import fake_evabyte, tiny_llama

V = 320


def _tiny_target_or_skip():  # type: ignore[no-untyped-def]
    from mtpc.backbones import tiny

    if not (tiny.TINY_TARGET_DIR / "model.safetensors").is_file():
        pytest.skip(
            f"tiny target assets not built yet ({tiny.REBUILD_COMMAND}); synthetic case runs instead"
        )
    return tiny.load_tiny_target()


def _targets(which: str):  # type: ignore[no-untyped-def]
    if which == "tiny":
        target = _tiny_target_or_skip()
        return target, target.mtp_unembeddings
    if which == "evabyte_fake":
        hf = fake_evabyte(2)
        return hf, hf.lm_head.weight.detach()
    hf = tiny_llama(2)
    mtp = torch.randn(8 * V, 32) * 0.2  # synthetic (8 * V, d) in EvaByte's layout
    return hf, mtp


@pytest.mark.parametrize("which", ["tiny", "evabyte_fake", "synthetic"])
def test_cp_equals_ff_at_step_zero_and_matches_mtp_heads(which: str) -> None:
    target, mtp = _targets(which)
    extra = None if which == "evabyte_fake" else mtp
    if which == "tiny":
        extra = None  # a TinyTarget carries its own
    ff = MTPCModel.from_hf(target, kind="ff", window=4, rank=1, mtp_unembeddings=extra)
    cp = MTPCModel.from_hf(target, kind="cp", window=4, rank=3, mtp_unembeddings=extra)
    d = ff.backbone.hidden_size
    ids = torch.randint(64, V, (2, 6))
    with torch.no_grad():
        hidden = ff.trunk(ids)
        x = torch.randint(0, V, (12, 4))
        lp_ff = ff.head.circuit.log_prob(ff.draft_params(hidden), x)
        lp_cp = cp.head.circuit.log_prob(cp.draft_params(hidden), x)
        torch.testing.assert_close(lp_cp, lp_ff, rtol=1e-5, atol=1e-5)
        # FF at step 0 is the product of the pretrained MTP heads (EvaByte layout)
        e = ff.draft_features(hidden).reshape(-1, d)  # (12, d)
        heads = mtp.reshape(8, V, d)[:4].to(e)  # (4, V, d)
        logp = torch.log_softmax(torch.einsum("bd,nvd->bnv", e, heads), -1)  # (12, 4, V)
        expected = logp.gather(2, x[:, :, None]).squeeze(2).sum(1)
        torch.testing.assert_close(lp_ff, expected, rtol=1e-4, atol=1e-4)


def test_head_init_falls_back_to_stp() -> None:
    hf = tiny_llama(2)
    model = MTPCModel.from_hf(hf, kind="cp", window=3, rank=2, extra_positions="repeat_last")
    w = model.head.unembedding  # (n, r, V, d)
    for i in range(3):
        for j in range(2):
            assert torch.equal(w[i, j], hf.lm_head.weight)
    model = MTPCModel.from_hf(tiny_llama(2), kind="cp", window=3, rank=2)  # default: random
    w = model.head.unembedding
    assert torch.equal(w[0, 1], model.backbone.stp_unembedding())
    assert torch.equal(w[2, 0], w[2, 1]) and not torch.equal(w[2, 0], w[0, 0])


def test_window_past_pretrained_heads() -> None:
    hf = fake_evabyte(1)
    model = MTPCModel.from_hf(hf, kind="ff", window=10, rank=1, extra_positions="repeat_last")
    w = model.head.unembedding[:, 0]  # (n, V, d)
    assert torch.equal(w[9], hf.lm_head.weight[7 * V : 8 * V])
    hf = fake_evabyte(1)
    model = MTPCModel.from_hf(hf, kind="ff", window=10, rank=1)
    w = model.head.unembedding[:, 0]
    assert torch.equal(w[7], hf.lm_head.weight[7 * V : 8 * V])
    assert not torch.equal(w[9], w[7])  # past the 8 pretrained heads: random


@pytest.mark.parametrize("lora_layers", [0, 1])
def test_packed_documents_do_not_attend_across_boundaries(lora_layers: int) -> None:
    """Each document of a packed row gets the features (and verifier logits) it has alone."""
    model = MTPCModel.from_hf(tiny_llama(), kind="cp", window=2, rank=2, lora_layers=lora_layers)
    torch.manual_seed(1)
    first, second = torch.randint(3, 40, (1, 5)), torch.randint(3, 40, (1, 7))
    packed = torch.cat([first, second], dim=1)  # (1, 12)
    documents = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    out = model(packed, True, positions=positions, documents=documents)
    alone = [model(doc, True) for doc in (first, second)]
    torch.testing.assert_close(out.draft_features[:, :5], alone[0].draft_features)
    torch.testing.assert_close(out.draft_features[:, 5:], alone[1].draft_features)
    assert out.verifier_logits is not None and alone[1].verifier_logits is not None
    torch.testing.assert_close(out.verifier_logits[:, 5:], alone[1].verifier_logits)
    # without the document mask the second document would see the first
    leaky = model(packed).draft_features[:, 5:]
    assert not torch.allclose(leaky, alone[1].draft_features, atol=1e-4)
