"""The only loader of hub remote code (EvaByte, tokenkit's byte Llama): the transformers
fixes of :mod:`mtpc.backbones.compat` (1-7) and, on EvaByte's triton path, the kernels of
:mod:`mtpc.backbones.evabyte_kernels` (8); docs/BACKBONES.md, "Loading real checkpoints"."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import torch
from torch import nn

from mtpc.backbones.compat import (
    OPTIONAL_PACKAGES,
    TargetLoadError,
    install_removed_module_shims,
    patch_remote_config,
    patch_remote_module,
    remote_imports,
    restore_non_persistent_buffers,
)
from mtpc.backbones.evabyte_kernels import (
    kernels_interpreted,
    kernels_path,
    prepare_eva_kernels,
    resolve_attention_impl,
    triton_available,
)

log = logging.getLogger(__name__)


def _forget_remote_package(module_name: str, keep: str) -> None:
    """Drops the remote package of ``module_name`` from ``sys.modules`` (except ``keep``), so
    the next import runs it again (EvaByte picks its attention path at import time)."""
    package = module_name.rpartition(".")[0]
    for name in [n for n in sys.modules if n.startswith(package + ".") and n != keep]:
        del sys.modules[name]
    importlib.invalidate_caches()


def load_remote_causal_lm(
    name: str,
    path: str,
    revision: str | None,
    dtype: torch.dtype,
    device: str,
    attention_impl: str = "auto",
    run_device: str | None = None,
) -> nn.Module:
    """Loads a ``trust_remote_code`` causal LM with fixes 1-6 and 8, on ``device``, in eval mode.
    ``name`` (``evabyte`` | ``llama3_byte``) picks the config defaults, optional packages and
    EvaByte's attention path, chosen for ``run_device`` (default ``device``). Raises TargetLoadError
    (a missing package, no remote model class) or AttentionImplError."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    label = f"model={name} (path={path!r})"
    install_removed_module_shims()
    optional = OPTIONAL_PACKAGES.get(name, frozenset())
    runs_on = run_device or device
    impl = resolve_attention_impl(attention_impl, runs_on, dtype) if name == "evabyte" else None
    blocked = frozenset({"triton"}) if impl == "torch" else frozenset()
    interpret = impl == "triton" and torch.device(runs_on).type != "cuda"
    if impl is not None:
        log.info(
            "%s: EVA attention path %r%s (model.attention_impl=%s, device=%s, triton %s%s)",
            label, impl, " on triton's CPU interpreter (TRITON_INTERPRET=1)" if interpret else "",
            attention_impl, runs_on, "installed" if triton_available() else "not installed",
            f"; loaded on {device}" if str(runs_on) != str(device) else "",
        )  # fmt: skip
    try:
        with remote_imports(optional, blocked):
            config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=True)
            class_ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
            if class_ref is None:
                raise TargetLoadError(
                    f"{label}: config.json has no auto_map.AutoModelForCausalLM; expected a "
                    "checkpoint with its modelling code (trust_remote_code)"
                )
            model_cls = get_class_from_dynamic_module(class_ref, path, revision=revision)
            module = sys.modules[model_cls.__module__]
            if impl is not None and (
                bool(getattr(module, "USE_TRITON_IMPL", False)) != (impl == "triton")
                or (impl == "triton" and kernels_interpreted(module) not in (None, interpret))
            ):  # imported earlier with the other path (or interpreter mode): import it again
                _forget_remote_package(model_cls.__module__, keep=type(config).__module__)
                model_cls = get_class_from_dynamic_module(class_ref, path, revision=revision)
                module = sys.modules[model_cls.__module__]
    except ImportError as error:
        missing = getattr(error, "name", None)
        what = f"imports {missing!r}, which is not installed" if missing else f"failed: {error}"
        raise TargetLoadError(f"{label}: its remote modelling code {what}") from error
    patch_remote_config(config, name)
    patch_remote_module(module)
    if impl == "triton":
        kernels = prepare_eva_kernels(module, config, dtype, runs_on)
        log.info("%s: EVA kernels %s, blocks %s", label, kernels_path(kernels),
                 kernels["blocks"] or "checked on the GPU")  # fmt: skip
    model: Any = model_cls.from_pretrained(path, config=config, revision=revision, dtype=dtype)  # type: ignore[attr-defined]
    replaced = restore_non_persistent_buffers(model, dtype)
    log.info("%s: rebuilt non-persistent buffers %s", label, replaced)
    model.to(device)
    model.eval()
    return model
