"""HF backbones behind one split-at-k interface, byte codecs and chat templates.

``load_backbone(name, path, revision, dtype, device)`` is the Hydra builder
(``model=tiny|evabyte|llama3_byte``); ``backbone_from_hf(hf_model)`` wraps an already
loaded model. See ``docs/BACKBONES.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtpc.backbones.base import DTYPES, Backbone, LayerCache, resolve_dtype
from mtpc.backbones.compat import ATTENTION_IMPLS, TargetLoadError
from mtpc.choices import MODEL_NAMES as BACKBONES

__all__ = [
    "ATTENTION_IMPLS",
    "BACKBONES",
    "DTYPES",
    "Backbone",
    "LayerCache",
    "TargetLoadError",
    "backbone_from_hf",
    "load_backbone",
    "resolve_dtype",
    "run_device_for",
]


def run_device_for(accelerator: str | None) -> str:
    """The device a trainer with ``trainer.accelerator`` runs the model on.

    ``gpu`` / ``cuda`` (and ``auto`` with a GPU) -> ``cuda:<LOCAL_RANK>`` (the GPU of this
    DDP / FSDP rank; 0 for one process), anything else -> ``cpu``. The trainer loads the
    target on the CPU and moves it there; the loader picks EvaByte's attention path for it.
    """
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
    """Loads a target by registry name (flat arguments for Hydra ``model=`` configs).

    Args:
        name: ``tiny`` (the bundled target), ``evabyte`` or ``llama3_byte``.
        path: local checkpoint or hub id; ``None``: the bundled assets / the hub id.
        revision: hub revision (ignored for ``tiny``).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (checked against ``device`` first).
        device: ``cpu`` or ``cuda[:i]``.
        attention_impl: EvaByte's attention path, ``auto`` (triton kernels on a GPU with
            triton, else pure torch), ``torch`` or ``triton``; ignored by the other targets.
        run_device: where the model will run, when it is loaded elsewhere (a trainer loads
            on ``cpu`` and runs on ``run_device_for(trainer.accelerator)``): EvaByte's
            attention path is chosen for it. ``None``: ``device``.
        **_: other ``model.*`` config fields (``codec``, ``trust_remote_code``) are ignored.

    Real targets (``evabyte``, ``llama3_byte``) are loaded through
    :mod:`mtpc.backbones.compat` and checked by :func:`mtpc.backbones.sanity.check_target`.

    Raises:
        ValueError: unknown name, a dtype the device cannot run, or an attention path that
            cannot run here, before loading anything.
        TargetLoadError: a real target cannot be loaded or fails its load-time check.
    """
    if name not in BACKBONES:
        raise ValueError(f"model.name is {name!r}; allowed: {list(BACKBONES)}")
    torch_dtype = resolve_dtype(dtype, device)
    if name == "evabyte":
        from mtpc.backbones.compat import resolve_attention_impl

        resolve_attention_impl(
            attention_impl, run_device or device, torch_dtype
        )  # before any download
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

    backbone = LlamaBackbone(
        hf_model, name="tiny", codec="tiny", source={"model": "tiny", "path": path}
    )
    backbone.extra_mtp = mtp_unembeddings
    return backbone


def _is_bundled_tiny(hf_model: nn.Module) -> bool:
    try:
        from mtpc.backbones.tiny import TINY_TARGET_DIR
    except ImportError:
        return False
    name = getattr(getattr(hf_model, "config", None), "_name_or_path", "") or ""
    return bool(name) and Path(name).resolve() == Path(TINY_TARGET_DIR).resolve()


def backbone_from_hf(target: Any, mtp_unembeddings: torch.Tensor | None = None) -> Backbone:
    """Wraps a loaded HF causal LM (or a ``TinyTarget``) in the matching backbone.

    Dispatch: ``config.model_type == "evabyte"`` -> EvaByte; a config with
    ``expand_input_ids`` -> the byte-level Llama; any other model with
    ``model.layers``/``model.norm``/``lm_head`` -> the Llama family.

    Raises:
        ValueError: the object is not a supported decoder-only LM.
    """
    if isinstance(target, Backbone):
        return target
    if (
        hasattr(target, "model")
        and hasattr(target, "mtp_unembeddings")
        and not isinstance(target, nn.Module)
    ):
        return tiny_backbone(target.model, target.mtp_unembeddings, None)  # a TinyTarget
    if not isinstance(target, nn.Module) or not hasattr(target, "config"):
        raise ValueError(f"target is a {type(target).__name__}; expected a Hugging Face causal LM")
    config = target.config
    if getattr(config, "model_type", None) == "evabyte":
        from mtpc.backbones.evabyte import EvaByteBackbone

        return EvaByteBackbone(target)
    if getattr(config, "expand_input_ids", False):
        from mtpc.backbones.llama3_byte import Llama3ByteBackbone

        return Llama3ByteBackbone(target)
    inner = getattr(target, "model", None)
    if not all(hasattr(inner, a) for a in ("layers", "norm", "embed_tokens")) or not hasattr(
        target, "lm_head"
    ):
        raise ValueError(
            f"target is a {type(target).__name__} without model.layers/model.norm/lm_head; "
            "supported: LlamaForCausalLM-compatible models, EvaByte, the byte-level Llama"
        )
    if _is_bundled_tiny(target):
        return tiny_backbone(target, mtp_unembeddings, None)
    from mtpc.backbones.llama import LlamaBackbone

    backbone = LlamaBackbone(target)
    backbone.extra_mtp = mtp_unembeddings
    return backbone
