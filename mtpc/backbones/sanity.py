"""Load-time check of a real target (meta tensors, rotary tables, the logits of a fixed prompt):
silent garbage must fail before training starts. See docs/BACKBONES.md, "Load-time check"."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtpc.backbones.codecs import get_codec
from mtpc.backbones.compat import TargetLoadError, compute_default_rope_parameters

PROMPT = "The quick brown fox jumps over the lazy dog. 0123456789"


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _closed_form_inv_freq(module: nn.Module, config: Any) -> torch.Tensor:
    """The inverse frequencies a rotary module must hold, from its config or attributes."""
    init_fn = getattr(module, "rope_init_fn", None)
    module_config = getattr(module, "config", None)
    if callable(init_fn) and module_config is not None:
        kwargs = getattr(module, "rope_kwargs", None) or {}
        return init_fn(module_config, torch.device("cpu"), **kwargs)[0].float()
    dim, base = getattr(module, "dim", None), getattr(module, "base", None)
    if isinstance(dim, int) and isinstance(base, int | float):
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float()
        return 1.0 / (float(base) ** (exponents / dim))  # (dim // 2,)
    return compute_default_rope_parameters(config)[0]


def rotary_problems(hf_model: nn.Module) -> list[str]:
    """Rotary buffers of ``hf_model`` that differ from their closed form (empty: all equal)."""
    problems = []
    config = getattr(hf_model, "config", None)
    for name, module in hf_model.named_modules():
        inv_freq = module._buffers.get("inv_freq")
        if inv_freq is None:
            continue
        expected = _closed_form_inv_freq(module, config)  # (hd / 2,)
        actual = inv_freq.detach().float().cpu()
        if actual.shape != expected.shape:
            shapes = f"{tuple(actual.shape)}, expected {tuple(expected.shape)}"
            problems.append(f"{name}.inv_freq has shape {shapes}")
            continue
        if not torch.allclose(actual, expected, rtol=_tolerance(inv_freq.dtype), atol=0):
            problems.append(
                f"{name}.inv_freq differs from its closed form 1/theta^(2i/d) (max abs error "
                f"{(actual - expected).abs().max().item():.3g}; first values "
                f"{actual.flatten()[:3].tolist()} vs {expected[:3].tolist()})"
            )
            continue
        cos = module._buffers.get("cos_cached")
        if cos is None or module._buffers.get("sin_cached") is None:
            continue
        positions = torch.arange(cos.shape[0], dtype=torch.float32)  # (S,)
        if "linear" in type(module).__name__.lower():
            positions = positions / float(getattr(module, "scaling_factor", 1.0))
        freqs = torch.outer(positions, expected)  # (S, hd / 2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
        for table, want in (("cos_cached", emb.cos()), ("sin_cached", emb.sin())):
            got = module._buffers[table].detach().float().cpu()
            tol = _tolerance(module._buffers[table].dtype)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=tol):
                error = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
                problems.append(
                    f"{name}.{table} differs from cos/sin(positions x inv_freq) "
                    f"(max abs error {error:.3g}, shape {tuple(got.shape)})"
                )
    return problems


def check_target(backbone: Any, label: str) -> None:
    """Raises TargetLoadError naming ``label`` (``model=evabyte (path=...)``) and every
    problem found if the loaded backbone is not the real model."""
    hf_model = backbone.hf_model
    tensors = [*hf_model.named_parameters(), *hf_model.named_buffers()]
    meta = [name for name, t in tensors if t.device.type == "meta"]
    problems = [f"{name} is still on the meta device" for name in meta[:5]]
    problems += rotary_problems(hf_model)
    if not problems:  # the STP logits of PROMPT through the split path, adapter off
        codec = get_codec(backbone.codec)
        ids = torch.tensor([[codec.bos_id, *codec.encode(PROMPT)]], device=backbone.device)
        with torch.no_grad():
            hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)  # (1, T, d)
            logits = backbone.stp_logits(backbone.norm(hidden)).float()  # (1, T, V)
        if not torch.isfinite(logits).all():
            bad = int((~torch.isfinite(logits)).sum())
            problems.append(
                f"the logits of a fixed {logits.shape[1]}-token prompt have {bad} non-finite values"
            )
        elif logits.std() == 0:
            problems.append("the logits of a fixed prompt are constant")
    if problems:
        raise TargetLoadError(
            f"{label} failed its load-time check (the loaded model is not the real model): "
            + "; ".join(problems)
            + ". See docs/BACKBONES.md, 'Loading real checkpoints'."
        )
