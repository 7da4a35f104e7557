"""Hub remote code (EvaByte, tokenkit's byte Llama), written for transformers 4.4x, under the
pinned 5.x: every generic workaround, numbered by the failure it fixes (docs/BACKBONES.md,
"Loading real checkpoints"): 1 optional kernel imports, 2 the 4.4x ``rope_scaling`` view, 3 the
"default" RoPE initialiser, 4 config keys the class lacks, 5 non-persistent buffers left empty, 6
removed transformers modules, 7 the decoder layers' cache keyword ("Following transformers").
Fix 8 (EvaByte's attention path and kernels) is :mod:`mtpc.backbones.evabyte_kernels`;
:func:`mtpc.backbones.remote_code.load_remote_causal_lm`, the only loader, applies them all."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mtpc.errors import UserError

log = logging.getLogger(__name__)

# Values for keys a config.json lacks (4). EvaByte: fp32_* as its checkpoint converter writes
# them; num_pred_heads = 1 as its constructor treats a missing key; mixedp_attn unverified.
REMOTE_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "evabyte": {"num_pred_heads": 1, "fp32_ln": True, "fp32_logits": True,
                "fp32_skip_add": False, "mixedp_attn": False},
    "llama3_byte": {},
}  # fmt: skip

# Packages a remote module may fail to import (1): the remote code has a fallback
# (EvaByte's pure-torch EVA) and only calls them on the GPU path.
OPTIONAL_PACKAGES: dict[str, frozenset[str]] = {
    "evabyte": frozenset({"triton"}),
    "llama3_byte": frozenset(),
}


class TargetLoadError(RuntimeError):
    """A real target could not be loaded, or loaded wrong (names the model and the problem)."""


class CacheInterfaceError(UserError, RuntimeError):
    """The installed transformers (or remote code) does not fill the KV cache as called (7)."""


# ------------------------------------------------------------ 7. cache keyword ----
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")  # newest transformers first


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def cache_keyword(layer_cls: type, default: str | None = None) -> str:
    """The keyword ``layer_cls.forward`` takes its KV cache by (first of :data:`CACHE_KEYWORDS`).
    ``default`` is returned when the signature names none; without one, CacheInterfaceError (a
    ``**kwargs`` catch-all is not trusted: a cache passed there may be dropped)."""
    params = inspect.signature(layer_cls.forward).parameters  # type: ignore[attr-defined]
    found = next((name for name in CACHE_KEYWORDS if name in params), default)
    if found is not None:
        return found
    raise CacheInterfaceError(
        f"{layer_cls.__module__}.{layer_cls.__qualname__}.forward takes none of the cache "
        f"keywords {list(CACHE_KEYWORDS)} (transformers {transformers_version()}); see "
        "docs/BACKBONES.md, 'Following transformers'"
    )


def cache_guard_message(backbone: Any, keyword: str, expected: int, got: int) -> str:
    """The one line a failed cache guard raises with."""
    return (
        f"{type(backbone).__name__}: the KV cache holds {got} positions after a pass that fed "
        f"it {expected} (transformers {transformers_version()}, cache keyword {keyword!r}): "
        "the installed transformers does not fill the cache as called; install the lock "
        "(scripts/setup.sh) or see docs/BACKBONES.md, 'Following transformers'"
    )


def output_cache(output: Any) -> Any:
    """The cache a forward returned (``cache`` from transformers 5.24, else ``past_key_values``)."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


# ---------------------------------------------------------------- 1. optional imports ----
def _unavailable(module: str, package: str, reason: str, name: str) -> Any:
    """A placeholder module's ``__getattr__`` (bound to its first three arguments): ``name`` is
    a function raising a clear error when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def placeholder(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"{module}.{name} needs {package}, which is {reason}")

    placeholder.__name__ = name
    return placeholder


class _RemoteModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of ``transformers_modules.*`` (remote code) and runs each with its own
    loader; one that fails importing an optional package is left a placeholder."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons  # optional package -> why it is missing

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("transformers_modules.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or spec.submodule_search_locations is not None:
            return spec
        spec.loader_state = spec.loader  # the file's own loader, run by exec_module
        spec.loader = self
        return spec

    def exec_module(self, module: ModuleType) -> None:
        try:
            module.__spec__.loader_state.exec_module(module)  # type: ignore[union-attr]
        except ModuleNotFoundError as error:
            package = (error.name or "").split(".")[0]
            reason = self.reasons.get(package)
            if reason is None:
                raise
            module.__getattr__ = functools.partial(_unavailable, module.__name__, package, reason)  # type: ignore[method-assign]
            module.__mtpc_unavailable__ = package  # type: ignore[attr-defined]
            message = "%s imports %s (%s): its functions are placeholders"
            log.info(message, module.__name__, package, reason)


@contextlib.contextmanager
def remote_imports(
    optional: frozenset[str] = frozenset(), blocked: frozenset[str] = frozenset()
) -> Iterator[None]:
    """Inside the block, a remote module failing on a missing ``optional`` package becomes a
    placeholder whose functions raise when called, and ``blocked`` packages are unimportable, so
    remote ``try: import ...`` fallbacks take their pure-torch path."""
    saved = {
        name: module
        for name, module in sys.modules.items()
        if any(name == p or name.startswith(p + ".") for p in blocked)
    }
    for name in saved:
        del sys.modules[name]
    for package in blocked:
        sys.modules[package] = None  # type: ignore[assignment]
    reasons = dict.fromkeys(optional, "not installed")
    reasons.update(dict.fromkeys(blocked, "disabled (model.attention_impl=torch)"))
    finder = _RemoteModuleFinder(reasons)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for package in blocked:
            sys.modules.pop(package, None)
        sys.modules.update(saved)


# ------------------------------------------------------------ 6. removed modules ----
# Modules 4.4x remote code imports that transformers removed -> our implementation.
REMOVED_MODULES: dict[str, str] = {
    "transformers.modeling_attn_mask_utils": "mtpc.backbones.legacy_attn_mask",  # gone in 5.24
}


def install_removed_module_shims() -> list[str]:
    """Serves each :data:`REMOVED_MODULES` entry the installed transformers no longer ships
    with ours; returns the module names now served by a shim."""
    installed = []
    for name, ours in REMOVED_MODULES.items():
        current = sys.modules.get(name)
        if current is not None:
            if getattr(current, "__name__", name) != name:
                installed.append(name)
            continue
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)
            continue
        shim = importlib.import_module(ours)
        sys.modules[name] = shim
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, shim)
        log.info("%s is not in transformers %s: serving %s", name, transformers_version(), ours)
        installed.append(name)
    return installed


# ------------------------------------------------------------ 2./4. remote config ----
def legacy_rope_scaling(rope_parameters: Any) -> dict[str, Any] | None:
    """The 4.4x ``rope_scaling`` of transformers 5's ``rope_parameters``: ``None`` for plain
    RoPE, else ``{"type": rope_type, <other keys but rope_theta>}``."""
    if not isinstance(rope_parameters, dict):
        return None
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type == "default":
        return None
    dropped = ("rope_theta", "rope_type", "type", "partial_rotary_factor")
    return {"type": rope_type, **{k: v for k, v in rope_parameters.items() if k not in dropped}}


def patch_remote_config(config: Any, name: str) -> None:
    """Makes a remote config read as its 4.4x code expects (in place; idempotent): the
    class's legacy ``rope_scaling`` view, :data:`REMOTE_CONFIG_DEFAULTS` for missing keys."""
    cls = type(config)
    base = getattr(cls, "rope_scaling", None)
    is_remote = cls.__module__.startswith("transformers_modules.")
    if is_remote and isinstance(base, property) and not getattr(cls, "_mtpc_legacy_rope", False):
        cls.rope_scaling = property(
            lambda config: legacy_rope_scaling(getattr(config, "rope_parameters", None)),
            base.fset,
            doc="rope_scaling as transformers 4.4x gave it (mtpc compat)",
        )
        cls._mtpc_legacy_rope = True
    for key, value in REMOTE_CONFIG_DEFAULTS.get(name, {}).items():
        if not hasattr(config, key):
            setattr(config, key, value)


# ------------------------------------------------------------ 3. remote module ----
def compute_default_rope_parameters(
    config: Any,
    device: torch.device | str | None = None,
    seq_len: int | None = None,
    layer_type: str | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    """Plain RoPE: (dim // 2,) float32 ``inv_freq[i] = 1 / theta ** (2i / dim)`` (dim =
    head_dim x partial factor) and the attention scaling 1.0."""
    params = getattr(config, "rope_parameters", None) or {}
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", 1.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * partial)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32)
    return 1.0 / (base ** (exponents / dim)), 1.0


def patch_remote_module(module: ModuleType) -> None:
    """Gives a remote module that looks up ``ROPE_INIT_FUNCTIONS["default"]`` its own copy
    of transformers' table with the plain-RoPE closed form added (transformers is untouched)."""
    table = getattr(module, "ROPE_INIT_FUNCTIONS", None)
    if isinstance(table, dict) and "default" not in table:
        module.ROPE_INIT_FUNCTIONS = {**table, "default": compute_default_rope_parameters}  # type: ignore[attr-defined]


# ------------------------------------------------------ 5. non-persistent buffers ----
@contextlib.contextmanager
def _skeleton_build(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, ``dtype`` is the default dtype and new parameters live on the meta
    device; buffers are real."""
    register = nn.Module.register_parameter
    previous = torch.get_default_dtype()

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        torch.set_default_dtype(previous)


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every non-persistent buffer of ``model`` by its full name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buffer
    return out


def restore_non_persistent_buffers(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Recomputes ``model``'s non-persistent buffers in place with its own ``__init__`` run with
    ``dtype`` as default dtype (as ``from_pretrained`` does), copying the plain tensor attributes
    of the buffers' modules too (``original_inv_freq``); returns the names replaced."""
    config = copy.deepcopy(model.config)
    build_dtype = dtype if dtype.is_floating_point else torch.float32
    with _skeleton_build(build_dtype), torch.device("cpu"):
        skeleton = type(model)(config)
    fresh = non_persistent_buffers(skeleton)
    replaced = []
    for full_name, old in non_persistent_buffers(model).items():
        if full_name not in fresh:
            continue
        module_name, _, name = full_name.rpartition(".")
        module = model.get_submodule(module_name)
        source = skeleton.get_submodule(module_name)
        device = old.device if old.device.type != "meta" else torch.device("cpu")
        module._buffers[name] = fresh[full_name].to(device)
        for attr, value in vars(source).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(module, attr, value.to(device))
        replaced.append(full_name)
    return replaced
