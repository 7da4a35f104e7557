"""HF backbones behind one split-at-k interface, byte codecs and chat templates. ``load_backbone``
is the Hydra builder (``model=tiny|evabyte|llama3_byte``); ``backbone_from_hf`` wraps an already
loaded model. See docs/BACKBONES.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtpc.backbones.base import DTYPES, Backbone, LayerCache, resolve_dtype
from mtpc.backbones.compat import TargetLoadError
from mtpc.choices import ATTENTION_IMPLS
from mtpc.choices import MODEL_NAMES as BACKBONES

__all__ = [
    "ATTENTION_IMPLS", "BACKBONES", "DTYPES", "Backbone", "LayerCache", "TargetLoadError",
    "backbone_class", "backbone_from_hf", "check_batch_size", "load_backbone", "resolve_dtype",
    "run_device_for",
]  # fmt: skip

CLASSES = {
    "tiny": ("mtpc.backbones.llama", "LlamaBackbone"),
    "evabyte": ("mtpc.backbones.evabyte", "EvaByteBackbone"),
    "llama3_byte": ("mtpc.backbones.llama3_byte", "Llama3ByteBackbone"),
}
"""The backbone class of each ``model.name`` (what a target can do, asked before it loads)."""


def backbone_class(name: str) -> type[Backbone] | None:
    """The backbone class ``load_backbone(name)`` builds; None: a name outside the registry."""
    if name not in CLASSES:
        return None
    import importlib

    module, cls = CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def check_batch_size(
    batch_size: Any,
    backbone: Backbone | type[Backbone] | None,
    count: int | None = None,
    *,
    model: str | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """The rows decoded at once: ``batch_size`` (None: ``count``, every prompt, where the
    backbone batches, else 1) at most ``count``. ``backbone``: the loaded one, or before
    loading the class of ``model=<name>`` (:func:`backbone_class`; None: not known, not
    refused). ``error``: the refusal's class, e.g. a settings error before anything loads."""
    batched = backbone is None or backbone.supports_batch
    if batch_size is None and count is not None:
        batch_size = count if batched else 1
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise error(f"batch_size is {batch_size!r}; allowed: an int >= 1 (or None)")
    if batch_size > 1 and not batched:
        name = backbone if isinstance(backbone, type) else type(backbone)
        who = f" for model={model}: it" if model else f": {name.__name__}"
        raise error(
            f"batch_size={batch_size} is not allowed{who} has no batched cache "
            "(supports_batch is False); allowed: batch_size=1"
        )
    return batch_size if count is None else min(batch_size, count)


def run_device_for(accelerator: str | None) -> str:
    """The device a trainer with ``trainer.accelerator`` runs the model on: ``gpu`` / ``cuda``
    (and ``auto`` with a GPU) -> ``cuda:<LOCAL_RANK>``, anything else -> ``cpu``."""
    import os

    name = str(accelerator or "cpu").lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def load_backbone(
    name: str,
    path: str | None = None,
    revision: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attention_impl: str = "auto",
    run_device: str | None = None,
    **_: Any,
) -> Backbone:
    """Loads a target by registry name (flat arguments for Hydra ``model=`` configs). ``path``:
    checkpoint or hub id (``None``: the bundled assets / the hub id). ``attention_impl`` (EvaByte
    only) is chosen for ``run_device`` (default ``device``), where a model loaded elsewhere will
    run. Other ``model.*`` fields are ignored. Raises ValueError before loading anything (name,
    dtype, attention path), TargetLoadError after."""
    if name not in BACKBONES:
        raise ValueError(f"model.name is {name!r}; allowed: {list(BACKBONES)}")
    torch_dtype = resolve_dtype(dtype, device)
    if name == "tiny":
        from mtpc.backbones.tiny import load_tiny_target

        target = load_tiny_target(path, dtype=torch_dtype)
        target.model.to(device)  # type: ignore[arg-type]
        return tiny_backbone(target.model, target.mtp_unembeddings.to(device), path)
    if name == "evabyte":
        from mtpc.backbones.evabyte import load_evabyte

        return load_evabyte(path, revision, torch_dtype, device, attention_impl, run_device)
    from mtpc.backbones.llama3_byte import load_llama3_byte

    return load_llama3_byte(path, revision, torch_dtype, device)


def tiny_backbone(
    hf_model: nn.Module, mtp_unembeddings: torch.Tensor | None, path: str | None = None
) -> Backbone:
    """The tiny target (a ``LlamaForCausalLM`` + EvaByte-layout MTP unembeddings)."""
    from mtpc.backbones.llama import LlamaBackbone

    source = {"model": "tiny", "path": path}
    return LlamaBackbone(hf_model, "tiny", codec="tiny", source=source, extra_mtp=mtp_unembeddings)


def backbone_from_hf(target: Any, mtp_unembeddings: torch.Tensor | None = None) -> Backbone:
    """Wraps a loaded HF causal LM (or a ``TinyTarget``) in the matching backbone: EvaByte by
    ``model_type``, the byte Llama by ``expand_input_ids``, else the Llama family (ValueError
    without ``model.layers/norm/embed_tokens`` and ``lm_head``)."""
    if isinstance(target, Backbone):
        return target
    plain = not isinstance(target, nn.Module)
    if plain and hasattr(target, "model") and hasattr(target, "mtp_unembeddings"):
        return tiny_backbone(target.model, target.mtp_unembeddings)  # a TinyTarget
    if plain or not hasattr(target, "config"):
        raise ValueError(f"target is a {type(target).__name__}; expected a Hugging Face causal LM")
    config = target.config
    if getattr(config, "model_type", None) == "evabyte":
        from mtpc.backbones.evabyte import EvaByteBackbone

        return EvaByteBackbone(target)
    if getattr(config, "expand_input_ids", False):
        from mtpc.backbones.llama3_byte import Llama3ByteBackbone

        return Llama3ByteBackbone(target)
    inner = getattr(target, "model", None)
    parts = ("layers", "norm", "embed_tokens")
    if not all(hasattr(inner, a) for a in parts) or not hasattr(target, "lm_head"):
        raise ValueError(
            f"target is a {type(target).__name__} without model.layers/model.norm/lm_head; "
            "supported: LlamaForCausalLM-compatible models, EvaByte, the byte-level Llama"
        )
    from mtpc.backbones.llama import LlamaBackbone
    from mtpc.backbones.tiny import TINY_TARGET_DIR

    name = getattr(config, "_name_or_path", "") or ""
    if name and Path(name).resolve() == TINY_TARGET_DIR.resolve():  # the bundled tiny target
        return tiny_backbone(target, mtp_unembeddings)
    return LlamaBackbone(target, extra_mtp=mtp_unembeddings)
