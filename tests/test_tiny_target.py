"""The bundled tiny target: offline loading, recorded validation loss, generation, assets."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from mtpc.backbones.codecs import get_codec
from mtpc.backbones.tiny import (
    NUM_MTP_HEADS,
    REBUILD_COMMAND,
    TINY_TARGET_DIR,
    TinyTarget,
    TinyTargetAssetError,
    load_tiny_target,
)
from mtpc.data.synthetic import load_synthetic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
try:  # the tiny target's pretraining tools live with its script
    from pretrain_tiny_target import build_tiny_config, tiny_generation_config, validation_metrics
finally:
    sys.path.pop(0)

# Measured once by scripts/pretrain_tiny_target.py (metadata.json "validation"), plus a margin.
VALIDATION_LOSS_BOUND = 0.19  # nats per next-byte target, every target
ASSISTANT_LOSS_BOUND = 0.31  # nats per assistant target


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Batch-1 work on a model this small is fastest, and robust to busy cores, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target() -> TinyTarget:
    return load_tiny_target()


def test_loads_offline_in_one_call(target: TinyTarget) -> None:
    model = target.model
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    config = model.config
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        320,
        1,
        2,
        0,
    )
    assert list(model.generation_config.eos_token_id) == [11, 2]
    d = config.hidden_size
    assert target.mtp_unembeddings.shape == (NUM_MTP_HEADS * 320, d)
    assert target.metadata["rebuild_command"] == REBUILD_COMMAND
    assert sum(f.stat().st_size for f in TINY_TARGET_DIR.iterdir()) < 10 * 2**20


def test_mtp_block_zero_is_lm_head(target: TinyTarget) -> None:
    assert torch.equal(target.mtp_unembeddings[:320], target.model.lm_head.weight)
    assert not torch.equal(target.mtp_unembeddings[320:640], target.model.lm_head.weight)


@pytest.mark.slow
def test_validation_loss_below_recorded_bound(target: TinyTarget, tmp_path: Path) -> None:
    rows = list(load_synthetic(tmp_path)["validation"])
    metrics = validation_metrics(target.model, rows, batch_size=64)
    assert metrics["loss"] < VALIDATION_LOSS_BOUND
    assert metrics["assistant_loss"] < ASSISTANT_LOSS_BOUND
    assert metrics["loss"] == pytest.approx(target.metadata["validation"]["loss"], rel=1e-3)


def test_mtp_heads_predict_ahead(target: TinyTarget, tmp_path: Path) -> None:
    rows = list(load_synthetic(tmp_path)["validation"])[:32]
    metrics = validation_metrics(target.model, rows, target.mtp_unembeddings)
    # heads further ahead are less certain, but all beat uniform (ln 320 = 5.77) by far
    losses = [metrics["loss"]] + [metrics[f"mtp_loss_{k}"] for k in range(1, NUM_MTP_HEADS)]
    assert losses[0] < losses[1] < losses[-1] < 2.0


def test_greedy_generate_on_chat_prompt(target: TinyTarget) -> None:
    codec = get_codec("tiny")
    prompt = codec.generation_prompt([{"role": "user", "content": "Name a primary colour."}])
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, max_new_tokens=32, do_sample=False)
    new = out[0, len(prompt) :].tolist()
    assert 0 < len(new) <= 32
    assert new[-1] in codec.stop_ids
    assert codec.decode(new) in ("Red.", "Blue.", "Yellow.")
    # the KV cache changes nothing: greedy with and without it agree
    config = tiny_generation_config()
    config.max_new_tokens = 16
    no_cache = target.model.generate(ids, generation_config=config, use_cache=False)
    assert torch.equal(out[:, : no_cache.shape[1]], no_cache)


@pytest.fixture
def asset_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny_target"
    shutil.copytree(TINY_TARGET_DIR, folder)
    return folder


@pytest.mark.parametrize(
    "name", ["model.safetensors", "mtp_heads.safetensors", "config.json", "metadata.json"]
)
def test_missing_asset_names_file_and_command(asset_copy: Path, name: str) -> None:
    (asset_copy / name).unlink()
    with pytest.raises(TinyTargetAssetError, match=name) as err:
        load_tiny_target(asset_copy)
    assert "is missing" in str(err.value)
    assert REBUILD_COMMAND in str(err.value)


@pytest.mark.parametrize("name", ["model.safetensors", "mtp_heads.safetensors"])
@pytest.mark.parametrize("verify", [True, False])
def test_truncated_weights_name_file_and_command(asset_copy: Path, name: str, verify: bool) -> None:
    path = asset_copy / name
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TinyTargetAssetError, match=name) as err:
        load_tiny_target(asset_copy, verify=verify)
    assert REBUILD_COMMAND in str(err.value)


def test_corrupt_metadata_names_file(asset_copy: Path) -> None:
    (asset_copy / "metadata.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TinyTargetAssetError, match=r"metadata\.json is corrupt"):
        load_tiny_target(asset_copy)


def test_flipped_byte_detected_by_checksum(asset_copy: Path) -> None:
    path = asset_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TinyTargetAssetError, match=r"model\.safetensors is corrupt \(sha256"):
        load_tiny_target(asset_copy)
    meta = json.loads((asset_copy / "metadata.json").read_text(encoding="utf-8"))
    assert set(meta["sha256"]) == {"config.json", "model.safetensors", "mtp_heads.safetensors"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"hidden_size": 100, "num_heads": 3}, "num_heads"),
    ],
)
def test_build_config_bad_sizes_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build_tiny_config(**kwargs)
