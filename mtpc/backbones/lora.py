"""LoRA on the draft tail: peft on layers ``L-k..L-1``, one copy of the base weights. The adapter is
on only while the draft tail runs, so the wrapped HF model keeps computing the target; LoRA
parameters keep peft's names. See docs/BACKBONES.md, "The split"."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

from mtpc.choices import LORA_TARGET_MODULES
from mtpc.config import LoraSettings

__all__ = ["LoraError", "LoraSettings", "LoraTail", "as_settings", "attach_lora", "validate_lora"]


class LoraError(ValueError):
    """A ``lora.*`` setting the target's layers cannot take; names the field."""


def validate_lora(settings: LoraSettings, layers: nn.ModuleList) -> None:
    """Checks k, rank, dropout and the target modules against the layers (LoraError naming
    the field and the allowed values, before anything is built)."""
    n = len(layers)
    if not 0 <= settings.layers <= n:
        raise LoraError(f"lora.layers (k) is {settings.layers}; allowed: 0..{n} (the layer count)")
    if settings.layers == 0:
        return
    if any(isinstance(m, LoraLayer) for m in layers.modules()):
        raise LoraError(
            "the target already carries a LoRA adapter (from another MTPCModel); "
            "load a fresh copy of the target for each draft with lora_layers > 0"
        )
    if settings.rank < 1:
        raise LoraError(f"lora.rank is {settings.rank}; allowed: an integer >= 1")
    if not 0.0 <= settings.dropout < 1.0:
        raise LoraError(f"lora.dropout is {settings.dropout}; allowed: 0 <= dropout < 1")
    if not settings.target_modules:
        raise LoraError("lora.target_modules is empty; name at least one linear module")
    last = layers[n - 1].named_modules()
    available = sorted({name.rsplit(".", 1)[-1] for name, m in last if isinstance(m, nn.Linear)})
    missing = [t for t in settings.target_modules if t not in available]
    if missing:
        raise LoraError(
            f"lora.target_modules {missing} do not exist in the layers; allowed: {available}"
        )


class LoraTail:
    """The injected adapter on the last k layers of an HF model."""

    def __init__(self, hf_model: nn.Module, num_layers: int, settings: LoraSettings) -> None:
        config = LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft accepts floats
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules),
            layers_to_transform=list(range(num_layers - settings.layers, num_layers)),
            layers_pattern="layers",
            bias="none",
        )
        inject_adapter_in_model(config, hf_model)
        self.modules: list[LoraLayer] = [m for m in hf_model.modules() if isinstance(m, LoraLayer)]
        self._model = [hf_model]  # not a submodule: no second registration
        for name, p in hf_model.named_parameters():
            p.requires_grad_("lora_" in name)
        self.set_enabled(False)

    def set_enabled(self, enabled: bool) -> None:
        """Adapter on (draft tail) or off (verifier tail, trunk, the HF model's forward)."""
        # peft's enable_adapters() also flips requires_grad; the flag alone keeps the LoRA
        # weights trainable while the verifier tail runs with the adapter off.
        for m in self.modules:
            m._disable_adapters = not enabled

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """LoRA parameters with peft's names (relative to the HF model)."""
        return [(n, p) for n, p in self._model[0].named_parameters() if "lora_" in n]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Loads LoRA weights by peft name (ValueError: missing or unexpected names, shapes);
        ``strict=False`` loads the names ``state`` holds and lets the others be."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if (strict and missing) or unexpected:
            raise ValueError(
                f"LoRA weights do not match the adapter: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
        with torch.no_grad():
            for name, p in own.items():
                if name not in state:
                    continue
                if p.shape != state[name].shape:
                    raise ValueError(
                        f"LoRA weight {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(state[name])


def attach_lora(
    hf_model: nn.Module, layers: nn.ModuleList, settings: LoraSettings
) -> LoraTail | None:
    """Injects LoRA into the last k layers (``None`` for k = 0); ``settings`` have passed
    :func:`validate_lora` (``MTPCModel.from_backbone`` checks them before building anything)."""
    return LoraTail(hf_model, len(layers), settings) if settings.layers else None


def as_settings(
    layers: int = 0,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | None = None,
) -> LoraSettings:
    """Flat arguments -> :class:`LoraSettings`."""
    return LoraSettings(
        layers=int(layers),
        rank=int(rank),
        alpha=float(alpha),
        dropout=float(dropout),
        target_modules=tuple(target_modules or LORA_TARGET_MODULES),
    )
