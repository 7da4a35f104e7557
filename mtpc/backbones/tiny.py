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
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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


def build_tiny_config(
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 352,
    max_position_embeddings: int = 1024,
) -> LlamaConfig:
    """A Llama config with EvaByte's vocabulary (320 ids) and special ids (ValueError: a size
    is not positive, or ``hidden_size`` is not divisible by ``num_heads``)."""
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    codec = get_codec("tiny")
    return LlamaConfig(
        vocab_size=codec.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
        tie_word_embeddings=False,
    )


def tiny_generation_config() -> GenerationConfig:
    """Greedy by default; stops at ``<|eot_id|>`` (11) or ``<eos>`` (2)."""
    codec = get_codec("tiny")
    return GenerationConfig(
        bos_token_id=codec.bos_id,
        eos_token_id=list(codec.stop_ids),
        pad_token_id=codec.pad_id,
        do_sample=False,
    )


def sha256_file(path: str | os.PathLike[str]) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_tiny_target(
    model: LlamaForCausalLM,
    mtp_unembeddings: torch.Tensor,
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
) -> Path:
    """Writes the asset folder (see the module docstring); returns its path.
    ``mtp_unembeddings`` (8 * V, d): block 0 must equal ``model.lm_head.weight``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = model.config.vocab_size
    if not torch.equal(mtp_unembeddings[:vocab], model.lm_head.weight):
        raise ValueError("mtp_unembeddings block 0 must equal model.lm_head.weight")
    model.generation_config = tiny_generation_config()
    model.save_pretrained(path)
    mtp = mtp_unembeddings.detach().contiguous().cpu()
    save_file({MTP_KEY: mtp}, path / "mtp_heads.safetensors")
    meta = {**metadata, "sha256": {name: sha256_file(path / name) for name in WEIGHT_FILES}}
    (path / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path


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


def encode_chats(
    rows: Sequence[Mapping[str, Any]], codec: ByteCodec | None = None
) -> list[tuple[list[int], list[bool]]]:
    """Renders Tülu-format rows with the chat template: (ids, assistant mask) per row."""
    codec = get_codec("tiny") if codec is None else codec
    encodings = [codec.apply_chat_template(row["messages"]) for row in rows]
    return [(enc.ids, enc.assistant_mask) for enc in encodings]


@torch.no_grad()
def validation_metrics(
    model: LlamaForCausalLM,
    rows: Sequence[Mapping[str, Any]],
    mtp_unembeddings: torch.Tensor | None = None,
    batch_size: int = 32,
) -> dict[str, float]:
    """Next-byte loss of ``model`` on chat rows, one row per sequence (no packing). Returns
    ``loss`` / ``bits_per_byte`` (mean NLL, nats / bits, every target after the first id),
    ``assistant_loss`` / ``assistant_bits_per_byte`` (assistant bytes and their ``<|eot_id|>``)
    and, with ``mtp_unembeddings``, ``mtp_loss_k`` (head k, byte t+1+k)."""
    model.eval()
    device = next(model.parameters()).device
    encoded = sorted(encode_chats(rows), key=lambda e: len(e[0]))  # little padding per batch
    pad = get_codec("tiny").pad_id  # padded positions are masked out anyway
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def add(key: str, nll: torch.Tensor, mask: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0.0) + float((nll * mask).sum())
        counts[key] = counts.get(key, 0.0) + float(mask.sum())

    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        rows_ids = [torch.tensor(row_ids) for row_ids, _ in chunk]
        masks = [torch.tensor(row_mask, dtype=torch.bool) for _, row_mask in chunk]
        ids = pad_sequence(rows_ids, batch_first=True, padding_value=pad).to(device)  # (B, T)
        valid = pad_sequence([torch.ones_like(m) for m in masks], batch_first=True).to(device)
        assistant = pad_sequence(masks, batch_first=True).to(device)  # (B, T)
        out = model.model(input_ids=ids, attention_mask=valid.long())
        hidden = out.last_hidden_state  # (B, T, d)
        log_probs = model.lm_head(hidden).float().log_softmax(-1)  # (B, T, V)
        nll = -log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        add("loss", nll, valid[:, 1:])
        add("assistant_loss", nll, assistant[:, 1:])
        if mtp_unembeddings is not None:
            logits = hidden.float() @ mtp_unembeddings.float().to(device).T  # (B, T, K * V)
            mtp = logits.unflatten(-1, (NUM_MTP_HEADS, -1)).log_softmax(-1)  # (B, T, K, V)
            for k in range(1, mtp.shape[2]):
                nll_k = -mtp[:, : -1 - k, k].gather(-1, ids[:, 1 + k :, None])[..., 0]  # (B, T-1-k)
                add(f"mtp_loss_{k}", nll_k, valid[:, 1 + k :])
    metrics = {key: sums[key] / max(counts[key], 1.0) for key in sums}
    metrics["bits_per_byte"] = metrics["loss"] / math.log(2)
    metrics["assistant_bits_per_byte"] = metrics["assistant_loss"] / math.log(2)
    return metrics
