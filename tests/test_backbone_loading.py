"""Loading trust_remote_code checkpoints through ``load_backbone`` gives the real model.

Each test writes its own hub-style checkpoint into ``tmp_path``
(``tests/fake_checkpoints.py``): ``config.json`` in the transformers 4.4x form with
``auto_map``, a remote package of our own writing (never third-party code) built on the
stand-ins of ``tests/fakes.py``, and ``model.safetensors``. The remote code reproduces what
breaks the real EvaByte / byte-Llama code under transformers 5: rotary tables registered as
non-persistent buffers in ``__init__`` (left uninitialised by meta-device loading),
``rope_scaling`` read in its old form (``["type"]``, ``["factor"]``),
``ROPE_INIT_FUNCTIONS["default"]``, a kernel module importing ``triton`` at import time, and
config keys the config class does not define. Loading must give logits identical to the
directly built model (the same class built on CPU with the same weights), rotary tables equal
to their closed form, or a clear error.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpc.backbones import TargetLoadError, evabyte_kernels, load_backbone, remote_code
from mtpc.backbones.sanity import rotary_problems
from tests.fake_checkpoints import (
    ABSENT_PACKAGE,
    eva_checkpoint,
    llama_checkpoint,
    stand_in_triton,
)

OLD_FORM_ROPE = [None, {"type": "linear", "factor": 2.0}]


def direct_build(loaded: Any, folder: Path) -> Any:
    """The loaded model's class built directly on CPU (buffers computed by its own __init__)
    from the same config, with the checkpoint's weights."""
    from safetensors.torch import load_file

    model = type(loaded)(loaded.config).eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[..., : model.config.vocab_size]


def split_logits(backbone: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits through the backbone's split path (what training and decoding use)."""
    with torch.no_grad():
        hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)
        return backbone.stp_logits(backbone.norm(hidden))


def closed_form(dim: int, positions: int, factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))  # (dim / 2,)
    t = torch.arange(positions, dtype=torch.float32) / factor
    emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)  # (positions, dim)
    return inv_freq, emb.cos(), emb.sin()


# ------------------------------------------------------------------------- tests ----
@pytest.mark.parametrize("rope_scaling", OLD_FORM_ROPE, ids=["rope_null", "rope_linear_old_form"])
def test_evabyte_checkpoint_loads_the_real_model_without_triton(
    tmp_path: Path, rope_scaling: dict[str, Any] | None
) -> None:
    folder, fake = eva_checkpoint(tmp_path, rope_scaling)
    backbone = load_backbone("evabyte", path=str(folder), dtype="float32", device="cpu")
    hf = backbone.hf_model
    # the rotary tables are the closed form (not meta-device garbage)
    factor = rope_scaling["factor"] if rope_scaling else 1.0
    want = closed_form(8, 96, factor)
    rotary = hf.model.rotary_emb
    for got, expected in zip(
        (rotary.inv_freq, rotary.cos_cached, rotary.sin_cached), want, strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # logits: the loaded model's forward and the split path equal the directly built model's
    ids = torch.randint(3, 320, (2, 21))
    ref = logits_of(direct_build(hf, folder), ids)
    torch.testing.assert_close(logits_of(hf, ids), ref, rtol=0, atol=0)
    torch.testing.assert_close(split_logits(backbone, ids), ref, rtol=0, atol=1e-5)
    if rope_scaling is None:  # plain RoPE: also the stand-in's own logits (independent of compat)
        torch.testing.assert_close(ref, logits_of(fake, ids), rtol=0, atol=1e-5)
    # config keys the class lacks: the checkpoint's value kept, the rest defaulted
    assert hf.config.num_pred_heads == 8 and hf.config.fp32_skip_add is False
    assert backbone.mtp_unembeddings().shape == (8, 320, 32)
    # no triton here: the pure-torch path, the kernel module a placeholder that says why
    remote = sys.modules[type(backbone.inner).__module__]
    assert remote.USE_TRITON_IMPL is False and backbone.use_triton is False
    kernels = sys.modules[remote.__name__.rpartition(".")[0] + ".eva_agg_kernel"]
    with pytest.raises(RuntimeError, match="triton"):
        kernels.eva_agg_func_triton()


@pytest.mark.parametrize("rope_scaling", OLD_FORM_ROPE, ids=["rope_null", "rope_linear_old_form"])
def test_byte_llama_checkpoint_loads_the_real_model(
    tmp_path: Path, rope_scaling: dict[str, Any] | None
) -> None:
    folder, fake = llama_checkpoint(tmp_path, rope_scaling)
    backbone = load_backbone("llama3_byte", path=str(folder), dtype="float32", device="cpu")
    hf = backbone.hf_model
    factor = rope_scaling["factor"] if rope_scaling else 1.0
    inv_freq = closed_form(8, 1)[0] / factor  # linear scaling divides the frequencies
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(hf.model.rotary_emb.original_inv_freq, inv_freq, rtol=1e-6, atol=0)
    ids = torch.randint(0, 272, (2, 19))
    ref = logits_of(direct_build(hf, folder), ids)
    torch.testing.assert_close(logits_of(hf, ids), ref, rtol=0, atol=0)
    torch.testing.assert_close(split_logits(backbone, ids), ref, rtol=0, atol=1e-5)
    if rope_scaling is None:
        torch.testing.assert_close(ref, logits_of(fake, ids), rtol=0, atol=1e-5)


def test_remote_code_importing_a_missing_package_is_a_clear_error(tmp_path: Path) -> None:
    folder, _ = llama_checkpoint(tmp_path, None, extra_import="from .fixture_helpers import *")
    with pytest.raises(
        TargetLoadError, match=rf"model=llama3_byte .*{ABSENT_PACKAGE}.*not installed"
    ):
        load_backbone("llama3_byte", path=str(folder), dtype="float32")


def test_uninitialised_rotary_buffers_fail_the_load_time_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the buffer rebuild, the sanity check names the model and the garbage table."""
    folder, _ = eva_checkpoint(tmp_path, None)

    def garble(model: Any, dtype: torch.dtype) -> list[str]:
        model.model.rotary_emb.inv_freq.fill_(-4.9e10)  # what transformers 5 leaves behind
        return []

    monkeypatch.setattr(remote_code, "restore_non_persistent_buffers", garble)
    with pytest.raises(TargetLoadError, match=r"model=evabyte .*rotary_emb\.inv_freq differs"):
        load_backbone("evabyte", path=str(folder), dtype="float32")


def test_rotary_check_accepts_closed_form_and_flags_cos_tables(tmp_path: Path) -> None:
    folder, _ = eva_checkpoint(tmp_path, {"type": "linear", "factor": 2.0})
    hf = load_backbone("evabyte", path=str(folder), dtype="float32").hf_model
    assert rotary_problems(hf) == []
    hf.model.rotary_emb.cos_cached.zero_()
    assert any("cos_cached differs" in p for p in rotary_problems(hf))


def test_attention_path_is_chosen_checked_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="attention_impl is 'flash'; allowed"):
        load_backbone("evabyte", path="/nonexistent", dtype="float32", attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl is 'triton'"):  # no triton / no GPU
        load_backbone("evabyte", path="/nonexistent", dtype="float32", attention_impl="triton")
    assert evabyte_kernels.resolve_attention_impl("auto", "cpu") == "torch"
    folder, _ = eva_checkpoint(tmp_path, None)
    with caplog.at_level(logging.INFO, logger="mtpc.backbones.remote_code"):
        backbone = load_backbone(
            "evabyte", path=str(folder), dtype="float32", attention_impl="torch"
        )
    assert backbone.use_triton is False
    assert "EVA attention path 'torch'" in caplog.text


def test_attention_impl_is_a_validated_model_field() -> None:
    from hydra import compose, initialize_config_dir

    from mtpc.config import ConfigError
    from mtpc.training.settings import validate_train_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=evabyte"])
        assert cfg.model.attention_impl == "auto"
        validate_train_config(cfg)
        bad = compose(
            config_name="train", overrides=["model=evabyte", "model.attention_impl=flash"]
        )
    with pytest.raises(
        ConfigError, match=r"model\.attention_impl='flash' is not allowed; allowed: auto"
    ):
        validate_train_config(bad)


def test_attention_path_switch_imports_the_remote_code_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EvaByte picks its path at import time: a load with the other path re-imports it."""
    stand_in_triton(tmp_path, monkeypatch)  # no kernels are ever run
    folder, _ = eva_checkpoint(tmp_path, None)
    paths = []
    try:
        for impl in ("torch", "triton", "torch"):
            monkeypatch.setattr(remote_code, "resolve_attention_impl", lambda *_, i=impl: i)
            model = remote_code.load_remote_causal_lm(
                "evabyte", str(folder), None, torch.float32, "cpu", impl
            )
            paths.append(sys.modules[type(model).__module__].USE_TRITON_IMPL)
    finally:
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]
    assert paths == [False, True, False]
