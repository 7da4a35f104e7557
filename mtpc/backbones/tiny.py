"""The bundled tiny targets: EvaByte-like byte LMs in ``assets/tiny_target`` (``model=tiny``,
synthetic chat) and ``assets/tiny_code`` (Python code, bf16), trained by
``scripts/pretrain_tiny_target.py``: a ``LlamaForCausalLM`` with EvaByte's 320-id layout and chat
template, plus 8 fully factorised MTP unembeddings. ``generation_config`` stops at ``[11, 2]``
(``<|eot_id|>``, ``<eos>``). Asset folder: ``config.json``, ``generation_config.json``,
``model.safetensors`` (fp32 or bf16: loading casts), ``mtp_heads.safetensors``
(``mtp_unembeddings`` (8 * 320, d): rows k*320..(k+1)*320-1 predict byte t+1+k from the normed
hidden state at t; block 0 equals ``lm_head.weight``) and ``metadata.json`` (training settings,
metrics, sha256 of the others)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from mtpc.backbones.codecs import ByteCodec, get_codec

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS_DIR = REPO_ROOT / "assets"
TINY_TARGET_DIR = ASSETS_DIR / "tiny_target"
TINY_CODE_DIR = ASSETS_DIR / "tiny_code"
REBUILD_COMMAND = "python scripts/pretrain_tiny_target.py"  # from the root: TINY_TARGET_DIR
# each folder's metadata.json holds its own rebuild_command
BUNDLED_TARGETS = {"tiny_target": TINY_TARGET_DIR, "tiny_code": TINY_CODE_DIR}
NUM_MTP_HEADS = 8
MTP_KEY = "mtp_unembeddings"
# the files whose sha256 metadata.json records and load_tiny_target checks
WEIGHT_FILES = ("config.json", "model.safetensors", "mtp_heads.safetensors")


class TinyTargetAssetError(RuntimeError):
    """A file of the tiny target's assets is missing or corrupt."""


@dataclass
class TinyTarget:
    """The loaded tiny target: ``model`` in eval mode, ``mtp_unembeddings`` (8 * 320, d),
    ``metadata.json``'s contents and the asset folder."""

    model: LlamaForCausalLM
    mtp_unembeddings: torch.Tensor
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path = TINY_TARGET_DIR

    @property
    def codec(self) -> ByteCodec:
        return get_codec("tiny")


def sha256_file(path: str | os.PathLike[str]) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def rebuild_command(folder: Path) -> str:
    """The command that rebuilds an asset folder: its ``metadata.json``'s ``rebuild_command``
    (the default target's command when that file cannot be read)."""
    try:
        command = json.loads((folder / "metadata.json").read_text(encoding="utf-8"))
        return str(command["rebuild_command"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        return REBUILD_COMMAND


def _asset_error(file: Path, problem: str) -> TinyTargetAssetError:
    folder = file.parent.resolve()
    relative = folder.relative_to(REPO_ROOT) if folder.is_relative_to(REPO_ROOT) else file.parent
    return TinyTargetAssetError(
        f"tiny target asset {file} {problem}. Rebuild the assets from the repository root "
        f"with: {rebuild_command(file.parent)} (or restore them with: git checkout -- "
        f"{relative})"
    )


def load_tiny_target(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> TinyTarget:
    """Loads the tiny target offline in one call. ``path``: asset folder (``TINY_TARGET_DIR``
    when None), or a ``BUNDLED_TARGETS`` name when no such folder exists here; ``verify``: check
    the sha256 of the weight files. TinyTargetAssetError names the file and its rebuild command."""
    folder = TINY_TARGET_DIR if path is None else Path(path)
    if path is not None and not folder.exists() and str(path) in BUNDLED_TARGETS:
        folder = BUNDLED_TARGETS[str(path)]
    for name in (*WEIGHT_FILES, "metadata.json"):
        if not (folder / name).is_file():
            raise _asset_error(folder / name, "is missing")
    try:
        metadata = json.loads((folder / "metadata.json").read_text(encoding="utf-8"))
        expected = metadata["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise _asset_error(folder / "metadata.json", f"is corrupt ({err})") from err
    if verify:
        for name in WEIGHT_FILES:
            if sha256_file(folder / name) != expected.get(name):
                raise _asset_error(folder / name, "is corrupt (sha256 differs from metadata.json)")
    try:
        model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, SafetensorError, json.JSONDecodeError) as err:
        raise _asset_error(folder / "model.safetensors", f"could not be loaded ({err})") from err
    mtp_file = folder / "mtp_heads.safetensors"
    try:
        mtp = load_file(mtp_file)[MTP_KEY].to(dtype)
    except (OSError, KeyError, SafetensorError) as err:
        raise _asset_error(mtp_file, f"could not be loaded ({err})") from err
    expected_shape = (NUM_MTP_HEADS * model.config.vocab_size, model.config.hidden_size)
    if tuple(mtp.shape) != expected_shape:
        shape = f"{MTP_KEY} of shape {tuple(mtp.shape)}, expected {expected_shape}"
        raise _asset_error(mtp_file, f"has {shape}")
    model.eval()
    return TinyTarget(model=model, mtp_unembeddings=mtp, metadata=metadata, path=folder)
