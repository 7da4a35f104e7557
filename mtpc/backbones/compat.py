"""Loading hub remote code (EvaByte, tokenkit's byte Llama) under the pinned transformers 5.x.

The remote modelling code of both real targets was written for transformers 4.4x. Every
workaround for the pinned transformers lives in this module, each named after the failure it
fixes (see ``docs/BACKBONES.md``, "Loading real checkpoints"):

1. **Kernel packages imported at import time** (EvaByte: ``eva_prep_kv_kernel.py`` imports
   ``triton`` unconditionally and ``multibyte_decoding_evabyte.py`` imports it, so the model
   cannot be imported without triton). :func:`remote_imports` turns a remote module that fails
   on an *optional* package into a placeholder whose functions raise when called, and can
   *block* a package so that the remote ``try: import triton`` falls back to the pure-torch
   path (``eva_pt_ref.py``). Any other missing package is a clear :class:`TargetLoadError`.
2. **rope_scaling rewritten**: transformers 5 makes ``config.rope_scaling`` an alias of the
   standardised ``rope_parameters`` (``{"rope_theta": ..., "rope_type": "default"}`` even when
   ``config.json`` says ``null``); EvaByte's ``_init_rope`` then fails with ``KeyError:
   'type'``. :func:`patch_remote_config` gives the remote config class back the 4.4x view
   (``None`` for plain RoPE, ``{"type": ..., "factor": ...}`` otherwise).
3. **No "default" RoPE initialiser**: transformers 5 dropped ``ROPE_INIT_FUNCTIONS["default"]``,
   which tokenkit's rotary embedding looks up (``KeyError: 'default'``).
   :func:`patch_remote_module` gives the remote module (only it) a copy with the closed form.
4. **Config keys the config class lacks** (EvaByte reads ``num_pred_heads``, ``fp32_ln``,
   ``fp32_logits``, ``fp32_skip_add``, ``mixedp_attn``; its class defines none of them). Hub
   ``config.json`` files carry them; :data:`REMOTE_CONFIG_DEFAULTS` fills the ones a config lacks.
5. **Non-persistent buffers left uninitialised**: transformers 5 builds every model on the
   meta device and then gives non-persistent buffers (rotary ``inv_freq``, ``cos_cached``,
   ``sin_cached``) ``torch.empty`` storage; only its own models recompute them. Remote models
   therefore run with garbage. :func:`restore_non_persistent_buffers` rebuilds the model's
   buffers by running its own ``__init__`` with parameters on the meta device (cheap) and
   copies every non-persistent buffer (and plain tensor attributes such as
   ``original_inv_freq``) into the loaded model.

:func:`load_remote_causal_lm` applies all five (and 6 and 8 below) and is the only loader of
remote code.

Two more places follow transformers' renames instead of pinning a release:

6. **Removed modules** that 4.4x remote code imports: transformers 5.24 removed
   ``transformers.modeling_attn_mask_utils`` (tokenkit imports ``AttentionMaskConverter`` from
   it). :func:`install_removed_module_shims` registers our own implementation of the names
   such code uses (:mod:`mtpc.backbones.legacy_attn_mask`) only when the real module is gone.
7. **The cache keyword of a decoder layer**: ``past_key_value`` (4.4x remote code),
   ``past_key_values`` (transformers 5.0-5.23), ``cache`` (5.24 and later).
   :func:`cache_keyword` reads it from the layer's signature once, at load time; a layer
   that names none of them is refused with :class:`CacheInterfaceError`. A keyword the layer
   accepts but ignores is caught by the per-pass cache guard (``Backbone.run_layers``), which
   raises the same error before any token is returned.

And one place wraps EvaByte's triton kernels (``docs/BACKBONES.md``, "The kernels on a CPU"):

8. **EvaByte's kernel host wrappers** (:func:`prepare_eva_kernels`, every triton-path load):
   their interface is checked at load time (:data:`KERNEL_INTERFACE`,
   :class:`KernelInterfaceError`); a window / chunk size the blocks of the run GPU compute
   wrongly is refused (:func:`check_kernel_blocks`, :class:`KernelBlockError`); the backward
   of a row no longer than one window gets zero-length RFAs instead of ``None``, which the
   remote code cannot take; and under triton's CPU interpreter (``TRITON_INTERPRET=1``,
   float32, :func:`resolve_attention_impl`) each wrapper's call sees CUDA tensors and the
   capability :func:`kernel_capability` (an H100's by default), for that call only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mtpc.choices import ATTENTION_IMPLS
from mtpc.errors import UserError

log = logging.getLogger(__name__)

# Values a remote config gets for keys its config.json lacks (the hub configs carry them).
# EvaByte: fp32_* as EvaByte's own checkpoint converter writes them ("legacy attributes");
# num_pred_heads = 1 is how EvaByteForCausalLM's constructor treats a missing key;
# mixedp_attn = False keeps the attention in the model's dtype (unverified, docs/BACKBONES.md).
REMOTE_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "evabyte": {
        "num_pred_heads": 1,
        "fp32_ln": True,
        "fp32_logits": True,
        "fp32_skip_add": False,
        "mixedp_attn": False,
    },
    "llama3_byte": {},
}

# Packages a remote module may fail to import without the model being unusable: the remote
# code has a fallback (EvaByte's pure-torch EVA) and only calls them on the GPU path.
OPTIONAL_PACKAGES: dict[str, frozenset[str]] = {
    "evabyte": frozenset({"triton"}),
    "llama3_byte": frozenset(),
}


class TargetLoadError(RuntimeError):
    """A real target could not be loaded, or loaded wrong (names the model and the problem)."""


class CacheInterfaceError(UserError, RuntimeError):
    """The installed transformers (or remote code) does not fill the KV cache as called.

    Raised at load time when a decoder layer names no known cache keyword, and after a
    cached pass whose native cache did not grow by what the pass fed it: one line naming the
    backbone class, the installed transformers version and the keyword, never a wrong token.
    """


# ------------------------------------------------------------ 7. cache keyword ----
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")
"""Names a decoder layer's forward takes its KV cache by, newest transformers first."""


def transformers_version() -> str:
    """The installed transformers version (``"not installed"`` without it)."""
    try:
        import transformers
    except ImportError:
        return "not installed"
    return str(transformers.__version__)


def cache_keyword(layer_cls: type, default: str | None = None) -> str:
    """The keyword ``layer_cls.forward`` takes its KV cache by (first of :data:`CACHE_KEYWORDS`).

    Args:
        layer_cls: a decoder layer's (or a causal LM's) class.
        default: returned when the signature names none (a stub taking ``**kwargs``);
            ``None`` refuses such a class.

    Raises:
        CacheInterfaceError: the signature names none of them and there is no default (a
            ``**kwargs`` catch-all is not trusted: a cache passed there may be dropped).
    """
    params = inspect.signature(layer_cls.forward).parameters  # type: ignore[attr-defined]
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    if default is not None:
        return default
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
    """The cache a model's forward returned: ``output.cache`` (transformers >= 5.24) or
    ``output.past_key_values`` (before); ``None`` when it returned none."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


# ---------------------------------------------------------------- 1. optional imports ----
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


class AttentionImplError(UserError, ValueError):
    """``model.attention_impl`` names a path that cannot run here (one line, the allowed values)."""


def triton_interpreter() -> bool:
    """Whether triton's CPU interpreter is switched on (``TRITON_INTERPRET``, read by triton
    itself; ``False`` without triton). Kernels decorated while it is on run on CPU tensors."""
    if not triton_available():
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # a triton without knobs (before 3.4): the variable
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_attention_impl(
    requested: str, device: str | torch.device, dtype: torch.dtype | str | None = None
) -> str:
    """EvaByte's attention path: ``triton`` (GPU kernels) or ``torch`` (``eva_pt_ref.py``).

    On a CPU, ``triton`` is accepted only in triton's interpreter mode (``TRITON_INTERPRET=1``
    with triton installed), float32 only: the interpreter's bf16 arithmetic is wrong (triton
    issue #11584). The interpreter runs the real kernels on CPU tensors, with the blocks of
    :func:`kernel_capability`'s GPU (docs/BACKBONES.md, "The kernels on a CPU").

    Args:
        requested: ``auto`` (triton when a CUDA device is used and triton is installed, else
            torch; never the interpreter), ``torch`` or ``triton``.
        device: where the model will run.
        dtype: the weights' dtype (checked in interpreter mode); ``None``: not checked.

    Returns:
        ``"torch"`` or ``"triton"``.

    Raises:
        AttentionImplError: unknown value, or ``triton`` where it cannot run (no triton; a CPU
            without the interpreter; the interpreter with bf16 or fp16).
    """
    if requested not in ATTENTION_IMPLS:
        raise AttentionImplError(
            f"model.attention_impl is {requested!r}; allowed: {list(ATTENTION_IMPLS)}"
        )
    on_gpu = torch.device(device).type == "cuda"
    if requested == "auto":
        return "triton" if on_gpu and triton_available() else "torch"
    if requested == "triton" and not triton_available():
        raise AttentionImplError(
            "model.attention_impl is 'triton' but triton is not installed; allowed here: "
            "['auto', 'torch']"
        )
    if requested == "triton" and not on_gpu:
        if not triton_interpreter():
            raise AttentionImplError(
                f"model.attention_impl is 'triton' but device is {str(device)!r}; triton kernels "
                "need a CUDA device (or TRITON_INTERPRET=1 for triton's CPU interpreter, float32); "
                "allowed on cpu: ['auto', 'torch']"
            )
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        if name is not None and name != "float32":
            raise AttentionImplError(
                f"model.dtype is {name!r} with model.attention_impl=triton under triton's CPU "
                "interpreter (TRITON_INTERPRET=1), whose bf16/fp16 arithmetic is wrong (triton "
                "issue #11584); allowed there: model.dtype=float32"
            )
        import triton.language.standard as triton_standard

        if type(triton_standard.sum).__name__ != "InterpretedFunction":
            raise AttentionImplError(
                "model.attention_impl is 'triton' on the CPU, but triton was imported before "
                "TRITON_INTERPRET=1 was set, so its own functions are compiled for a GPU; set "
                "TRITON_INTERPRET=1 in the environment before Python starts "
                "(TRITON_INTERPRET=1 python train.py ...)"
            )
    return requested


def _unavailable(module: str, package: str, reason: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` whose names are functions raising a clear error when called."""

    def getattr_(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def placeholder(*_: Any, **__: Any) -> Any:
            raise RuntimeError(f"{module}.{name} needs {package}, which is {reason}")

        placeholder.__name__ = name
        return placeholder

    return getattr_


class _StubOnOptionalImport(importlib.abc.Loader):
    """Runs a remote module; if it fails importing an optional package, leaves a placeholder."""

    def __init__(self, loader: Any, optional: frozenset[str], blocked: frozenset[str]) -> None:
        self.loader = loader
        self.optional = optional
        self.blocked = blocked

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        except ModuleNotFoundError as error:
            package = (error.name or "").split(".")[0]
            if package not in self.optional:
                raise
            blocked = package in self.blocked
            reason = "disabled (model.attention_impl=torch)" if blocked else "not installed"
            module.__getattr__ = _unavailable(module.__name__, package, reason)  # type: ignore[method-assign]
            module.__mtpc_unavailable__ = package  # type: ignore[attr-defined]
            log.info(
                "%s imports %s (%s): its functions are placeholders",
                module.__name__,
                package,
                reason,
            )


class _RemoteModuleFinder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of ``transformers_modules.*`` (remote code) in :class:`_StubOnOptionalImport`."""

    def __init__(self, optional: frozenset[str], blocked: frozenset[str]) -> None:
        self.optional = optional
        self.blocked = blocked

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("transformers_modules.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or spec.submodule_search_locations is not None:
            return spec
        spec.loader = _StubOnOptionalImport(spec.loader, self.optional, self.blocked)
        return spec


@contextlib.contextmanager
def remote_imports(
    optional: frozenset[str] = frozenset(), blocked: frozenset[str] = frozenset()
) -> Iterator[None]:
    """Imports of remote code inside the block tolerate missing ``optional`` packages.

    Args:
        optional: packages a remote module may fail to import; that module becomes a
            placeholder whose functions raise when called.
        blocked: packages made unimportable inside the block (``import triton`` raises), so
            remote ``try: import ...`` fallbacks take their pure-torch path. Restored after.
    """
    saved = {
        name: module
        for name, module in sys.modules.items()
        if any(name == p or name.startswith(p + ".") for p in blocked)
    }
    for name in saved:
        del sys.modules[name]
    for package in blocked:
        sys.modules[package] = None  # type: ignore[assignment]
    finder = _RemoteModuleFinder(optional | blocked, blocked)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for package in blocked:
            sys.modules.pop(package, None)
        sys.modules.update(saved)


def _forget_remote_package(module_name: str, keep: str) -> None:
    """Drops the remote package of ``module_name`` from ``sys.modules`` (except ``keep``), so
    the next import runs it again (EvaByte picks its attention path at import time)."""
    package = module_name.rpartition(".")[0]
    for name in [n for n in sys.modules if n.startswith(package + ".") and n != keep]:
        del sys.modules[name]
    importlib.invalidate_caches()


# ------------------------------------------------------------ 6. removed modules ----
REMOVED_MODULES: dict[str, str] = {
    "transformers.modeling_attn_mask_utils": "mtpc.backbones.legacy_attn_mask",  # gone in 5.24
}
"""Modules 4.4x remote code imports that transformers removed -> our implementation."""


def install_removed_module_shims() -> list[str]:
    """Registers our implementation of each :data:`REMOVED_MODULES` entry the installed
    transformers no longer ships (a module it still ships is left alone).

    Returns:
        The module names now served by a shim.
    """
    installed = []
    for name, ours in REMOVED_MODULES.items():
        current = sys.modules.get(name)
        if current is not None:
            if getattr(current, "__name__", name) != name:
                installed.append(name)
            continue
        try:
            importlib.import_module(name)
            continue
        except ModuleNotFoundError:
            pass
        shim = importlib.import_module(ours)
        sys.modules[name] = shim
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, shim)
        log.info("%s is not in transformers %s: serving %s", name, transformers_version(), ours)
        installed.append(name)
    return installed


# ------------------------------------------------------------ 2./4. remote config ----
def legacy_rope_scaling(rope_parameters: Any) -> dict[str, Any] | None:
    """The 4.4x ``rope_scaling`` of transformers 5's standardised ``rope_parameters``.

    ``None`` for plain RoPE; otherwise ``{"type": rope_type, <its other keys>}`` without
    ``rope_theta`` (EvaByte reads ``["type"]`` and ``["factor"]``; tokenkit reads the type).
    """
    if not isinstance(rope_parameters, dict):
        return None
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type == "default":
        return None
    dropped = ("rope_theta", "rope_type", "type", "partial_rotary_factor")
    return {"type": rope_type, **{k: v for k, v in rope_parameters.items() if k not in dropped}}


def _legacy_rope_scaling_property(base: Any) -> property:
    setter = base.fset

    def getter(config: Any) -> dict[str, Any] | None:
        return legacy_rope_scaling(getattr(config, "rope_parameters", None))

    return property(getter, setter, doc="rope_scaling as transformers 4.4x gave it (mtpc compat)")


def patch_remote_config(config: Any, name: str) -> None:
    """Makes a remote config read as its 4.4x code expects (in place; idempotent).

    Gives the config's (remote) class the legacy ``rope_scaling`` view and sets
    :data:`REMOTE_CONFIG_DEFAULTS` keys the config lacks.
    """
    cls = type(config)
    base = getattr(cls, "rope_scaling", None)
    is_remote = cls.__module__.startswith("transformers_modules.")
    if is_remote and isinstance(base, property) and not getattr(cls, "_mtpc_legacy_rope", False):
        cls.rope_scaling = _legacy_rope_scaling_property(base)
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
    """Plain RoPE: ``inv_freq[i] = 1 / theta ** (2i / dim)`` (dim = head_dim x partial factor).

    Returns:
        (dim // 2,) float32 inverse frequencies and the attention scaling 1.0.
    """
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
def _parameters_on_meta() -> Iterator[None]:
    """Inside the block, new parameters live on the meta device; buffers are real."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
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
    """Recomputes ``model``'s non-persistent buffers with its own ``__init__`` (in place).

    Builds the same class from a copy of its config with parameters on the meta device and
    ``dtype`` as the default dtype (what ``from_pretrained`` sets while it builds), then copies
    each non-persistent buffer, and the plain tensor attributes of the modules holding them
    (``original_inv_freq``), into ``model`` on the device of the buffer they replace.

    Returns:
        The names of the buffers replaced.
    """
    config = copy.deepcopy(model.config)
    build_dtype = dtype if dtype.is_floating_point else torch.float32
    with _default_dtype(build_dtype), _parameters_on_meta(), torch.device("cpu"):
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


# ------------------------------------------------------------ 8. EVA's triton kernels ----
INTERPRETER_CAPABILITY = (9, 0)
"""The GPU whose kernel blocks triton's CPU interpreter mode uses: the CUDA compute capability
the remote ``_get_config`` is told (9.0, an H100). ``MTPC_TRITON_CAPABILITY=8.0`` (an A100)
overrides it; docs/BACKBONES.md, "The kernels on a CPU"."""

CAPABILITY_ENV = "MTPC_TRITON_CAPABILITY"

KERNEL_INTERFACE: dict[str, dict[str, tuple[str, ...]]] = {
    "eva_agg_kernel": {
        "_get_config": ("dtype", "head_dim", "mode"),
        "triton_eva_agg_fwd": (
            "q", "k", "v", "rfa_k", "rfa_v", "window_mask", "chunk_mask", "softmax_scale",
            "window_size", "chunks_per_window",
        ),
        "triton_eva_agg_bwd": (
            "do", "q", "k", "v", "rfa_k", "rfa_v", "window_mask", "chunk_mask", "o", "lse",
            "dq", "dk", "dv", "d_rfa_k", "d_rfa_v", "softmax_scale", "window_size",
            "chunks_per_window", "empty_rfa_kv", "mask_type",
        ),
    },
    "eva_prep_kv_kernel": {
        "triton_eva_prep_kv_fwd": (
            "k", "v", "param_mu", "param_phi", "mask", "softmax_scale", "chunksize",
        ),
        "triton_eva_prep_kv_bwd": (
            "d_rfa_k", "d_rfa_v", "k", "v", "param_mu", "param_phi", "mask", "rfa_k", "rfa_v",
            "d_k", "d_v", "d_param_mu", "d_param_phi", "softmax_scale", "mask_type", "chunksize",
        ),
    },
}  # fmt: skip
"""The host wrappers of EvaByte's kernels (OpenEvaByte/evabyte @ 432331a) that
:func:`prepare_eva_kernels` wraps, with their parameters: checked at load time."""

KERNEL_MODES = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_drfa_kv")
"""The ``mode``s of ``eva_agg_kernel._get_config`` (one block table each)."""

PREP_KV_BLOCK = 128
"""``eva_prep_kv_kernel``'s fixed key block (``BLOCK = 128``); a chunk must divide it."""


class KernelInterfaceError(TargetLoadError):
    """EvaByte's remote kernel code no longer has the interface compat wraps (one line)."""


class KernelBlockError(UserError, ValueError):
    """The EVA window / chunk sizes and the kernels' blocks give wrong attention (one line)."""


def kernel_capability() -> tuple[int, int]:
    """The compute capability the interpreter mode picks blocks for
    (:data:`INTERPRETER_CAPABILITY`, or ``MTPC_TRITON_CAPABILITY=<major>.<minor>``).

    Raises:
        AttentionImplError: ``MTPC_TRITON_CAPABILITY`` is not ``<major>.<minor>``.
    """
    value = os.environ.get(CAPABILITY_ENV, "").strip()
    if not value:
        return INTERPRETER_CAPABILITY
    major, dot, minor = value.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise AttentionImplError(
            f"{CAPABILITY_ENV}={value!r} is not a CUDA compute capability; allowed: "
            "<major>.<minor>, e.g. 9.0 (H100) or 8.0 (A100)"
        )
    return int(major), int(minor or 0)


_host_depth = 0


@contextlib.contextmanager
def _kernels_see_gpu(capability: tuple[int, int] | None, cpu_tensors: bool) -> Iterator[None]:
    """Inside the block, ``torch.cuda.get_device_capability()`` returns ``capability`` (unless
    ``None``) and, with ``cpu_tensors``, every tensor answers ``is_cuda`` with ``True``: the
    remote host wrappers' CUDA-only asserts and block lookup, for triton's interpreter. Both are
    restored on leaving the outermost block."""
    global _host_depth
    saved = torch.cuda.get_device_capability
    own = vars(torch.Tensor).get("is_cuda")  # None: TensorBase's, which the property shadows
    if _host_depth == 0:
        if capability is not None:
            torch.cuda.get_device_capability = lambda device=None: capability
        if cpu_tensors:
            torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[assignment]
    _host_depth += 1
    try:
        yield
    finally:
        _host_depth -= 1
        if _host_depth == 0:
            torch.cuda.get_device_capability = saved
            if cpu_tensors and own is None:
                del torch.Tensor.is_cuda
            elif cpu_tensors:
                torch.Tensor.is_cuda = own  # type: ignore[assignment]


def _kernel_modules(package: str) -> dict[str, ModuleType]:
    """The remote package's kernel modules named in :data:`KERNEL_INTERFACE`.

    Raises:
        KernelInterfaceError: one is missing or a wrapper's parameters changed.
    """
    found = {}
    for short, functions in KERNEL_INTERFACE.items():
        module = sys.modules.get(f"{package}.{short}")
        if module is None or getattr(module, "__mtpc_unavailable__", None):
            raise KernelInterfaceError(
                f"EvaByte's remote code has no importable {short}.py (package {package}); "
                "compat wraps the kernels of OpenEvaByte/evabyte @ 432331a (docs/BACKBONES.md)"
            )
        for name, params in functions.items():
            function = getattr(module, name, None)
            function = getattr(function, "__mtpc_original__", function)
            got = tuple(inspect.signature(function).parameters) if callable(function) else None
            if got != params:
                raise KernelInterfaceError(
                    f"EvaByte's remote {short}.{name} has parameters {got}, not {params}: the "
                    "remote kernel interface changed; compat wraps the one of OpenEvaByte/evabyte "
                    "@ 432331a (docs/BACKBONES.md)"
                )
        found[short] = module
    code = inspect.unwrap(found["eva_agg_kernel"]._get_config).__code__
    if not {"cuda", "get_device_capability"} <= set(code.co_names):
        raise KernelInterfaceError(
            "EvaByte's remote eva_agg_kernel._get_config no longer picks its blocks by "
            "torch.cuda.get_device_capability(); compat cannot choose them (docs/BACKBONES.md)"
        )
    return found


def kernel_blocks(
    agg_kernel: ModuleType, dtype: torch.dtype, head_dim: int, capability: tuple[int, int]
) -> dict[str, tuple[int, int]]:
    """``{mode: (BLOCK_M, BLOCK_N)}`` as the remote ``_get_config`` picks them on a GPU of
    ``capability`` (every mode of :data:`KERNEL_MODES`)."""
    with _kernels_see_gpu(capability, cpu_tensors=False):
        return {m: tuple(agg_kernel._get_config(dtype, head_dim, m)[:2]) for m in KERNEL_MODES}


def check_kernel_blocks(
    window: int,
    chunk: int,
    blocks: dict[str, tuple[int, int]],
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
) -> None:
    """Refuses an EVA window / chunk size whose blocks the kernels compute wrongly or assert on.

    Each program of the aggregation kernels handles rows (or keys) of one window only
    (``offs_w = start_m * BLOCK_M // WINDOW_SIZE``), so ``BLOCK_M`` (and ``bwd_dkdv``'s key
    block ``BLOCK_N``) must divide the window: a ``BLOCK_M`` larger than the window gives wrong
    attention and nothing asserts it. The chunk loops need ``chunks_per_window`` a multiple of
    ``BLOCK_N`` (the remote code asserts it, but only mid-run);
    ``eva_prep_kv_kernel`` needs the chunk to divide its block of :data:`PREP_KV_BLOCK`.

    Raises:
        KernelBlockError: one line naming the sizes, the blocks and the GPU capability.
    """
    problems = []
    per_window = window // chunk if chunk else 0
    for mode, (block_m, block_n) in blocks.items():
        if window % block_m:
            problems.append(f"{mode} BLOCK_M={block_m} does not divide window_size={window}")
        if mode == "bwd_dkdv":  # key tiles, one window each
            if window % block_n:
                problems.append(f"{mode} BLOCK_N={block_n} does not divide window_size={window}")
        elif per_window < block_n or per_window % block_n:  # chunk tiles
            problems.append(
                f"{mode} BLOCK_N={block_n} does not divide chunks_per_window={per_window}"
            )
    if not chunk or PREP_KV_BLOCK % chunk or chunk >= PREP_KV_BLOCK:
        problems.append(f"chunk_size={chunk} does not divide eva_prep_kv's block {PREP_KV_BLOCK}")
    if problems:
        major, minor = capability
        rows = max(max(m, n if mode == "bwd_dkdv" else 1) for mode, (m, n) in blocks.items())
        chunks = max((n for mode, (_, n) in blocks.items() if mode != "bwd_dkdv"), default=1)
        raise KernelBlockError(
            f"model=evabyte with model.attention_impl=triton: EVA window_size={window}, "
            f"chunk_size={chunk} do not fit the kernels' blocks on a GPU of capability "
            f"{major}.{minor} ({dtype}, head_dim {head_dim}): {'; '.join(problems)}; allowed: "
            f"window_size a multiple of {rows} and window_size / chunk_size a multiple of "
            f"{chunks}, chunk_size dividing {PREP_KV_BLOCK} (e.g. window_size="
            f"{max(rows, chunks * 4)}, chunk_size=4), or model.attention_impl=torch"
        )


def _empty_rfa_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``triton_eva_agg_bwd`` that takes ``rfa_k = rfa_v = None`` (no compressed chunk yet: a
    row no longer than one window): the remote asserts on ``rfa_k.stride(-1)`` even then, so
    zero-length RFA tensors are passed instead (its kernels skip them: ``empty_rfa_kv=1``)."""

    @functools.wraps(original)
    def backward(
        do: Any, q: Any, k: Any, v: Any, rfa_k: Any, rfa_v: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if rfa_k is None and rfa_v is None:
            rfa_k = rfa_v = q.new_empty(q.shape[0], q.shape[1], 0, q.shape[-1])  # (B, h, 0, hd)
        return original(do, q, k, v, rfa_k, rfa_v, *args, **kwargs)

    return backward


def _on_interpreter(
    original: Callable[..., Any], capability: tuple[int, int]
) -> Callable[..., Any]:
    """A host wrapper run with :func:`_kernels_see_gpu` for the duration of the call."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _kernels_see_gpu(capability, cpu_tensors=True):
            return original(*args, **kwargs)

    return call


def prepare_eva_kernels(
    model_module: ModuleType,
    config: Any,
    dtype: torch.dtype,
    run_device: str | torch.device,
) -> dict[str, Any]:
    """Readies EvaByte's remote kernels for a triton-path model (in place, idempotent).

    1. Checks the kernels' interface (:data:`KERNEL_INTERFACE`; :class:`KernelInterfaceError`).
    2. Refuses an EVA window / chunk the blocks of the run device's GPU (the interpreter: of
       :func:`kernel_capability`) compute wrongly (:func:`check_kernel_blocks`).
    3. Wraps ``triton_eva_agg_bwd`` so that a row no longer than one window (no RFA yet) has
       a backward (:func:`_empty_rfa_backward`; on GPUs too).
    4. On a CPU (triton's interpreter): every host wrapper runs with
       :func:`_kernels_see_gpu` for the duration of its call.

    Every module of the remote package holding a wrapper gets the wrapped one.

    Returns:
        ``{"interpreter": bool, "capability": (major, minor) | None, "blocks": {mode: (M, N)}}``
        (also stored as the model module's ``__mtpc_kernels__``).
    """
    package = model_module.__name__.rpartition(".")[0]
    modules = _kernel_modules(package)
    interpreter = torch.device(run_device).type != "cuda"
    if interpreter and not (
        "is_cuda" in vars(torch._C.TensorBase)
        and callable(getattr(torch.cuda, "get_device_capability", None))
    ):  # what the interpreter's host shim shadows for the duration of a call
        raise KernelInterfaceError(
            f"torch {torch.__version__} has no TensorBase.is_cuda or "
            "torch.cuda.get_device_capability(): the interpreter's host shim cannot run"
        )
    capability: tuple[int, int] | None
    if interpreter:
        capability = kernel_capability()
    elif torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(torch.device(run_device)))  # type: ignore[assignment]
    else:  # a GPU run prepared on a machine without one: its blocks are checked where it runs
        capability = None
    head_dim = int(config.hidden_size) // int(config.num_attention_heads)
    blocks = {}
    if capability is not None:
        blocks = kernel_blocks(modules["eva_agg_kernel"], dtype, head_dim, capability)
        check_kernel_blocks(
            int(config.window_size), int(config.chunk_size), blocks, capability, dtype, head_dim
        )
    wrapped: dict[int, Callable[..., Any]] = {}
    for short, functions in KERNEL_INTERFACE.items():
        module = modules[short]
        for name in functions:
            if name == "_get_config":
                continue
            current = getattr(module, name)
            original = getattr(current, "__mtpc_original__", current)
            new = _empty_rfa_backward(original) if name == "triton_eva_agg_bwd" else original
            if interpreter:
                assert capability is not None
                new = _on_interpreter(new, capability)
            if new is not original:
                setattr(new, "__mtpc_original__", original)  # noqa: B010
            wrapped[id(current)] = wrapped[id(original)] = new
    for name in [n for n in sys.modules if n.startswith(package + ".")]:
        module = sys.modules[name]
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])
    info = {"interpreter": interpreter, "capability": capability, "blocks": blocks}
    model_module.__mtpc_kernels__ = info  # type: ignore[attr-defined]
    return info


def kernels_interpreted(model_module: ModuleType) -> bool | None:
    """Whether the remote kernels were imported under triton's interpreter (``None``: unknown:
    the package has no kernel module with a triton function)."""
    package = model_module.__name__.rpartition(".")[0]
    module = sys.modules.get(f"{package}.eva_agg_kernel")
    for value in vars(module).values() if module is not None else ():
        fn = value
        while fn is not None and hasattr(fn, "fn") and type(fn).__name__ != "InterpretedFunction":
            fn = fn.fn
        if type(fn).__name__ == "InterpretedFunction":
            return True
        if type(fn).__name__ == "JITFunction":
            return False
    return None


# ------------------------------------------------------------------------ loader ----
def kernels_path(kernels: dict[str, Any] | None) -> str:
    """The triton attention path in words, from :func:`prepare_eva_kernels`'s result:
    ``triton``, or ``triton (CPU interpreter, the blocks of a GPU of capability 9.0)``."""
    if not (kernels and kernels["interpreter"]):
        return "triton"
    capability = ".".join(map(str, kernels["capability"] or ()))
    return f"triton (CPU interpreter, the blocks of a GPU of capability {capability})"


def load_remote_causal_lm(
    name: str,
    path: str,
    revision: str | None,
    dtype: torch.dtype,
    device: str,
    attention_impl: str = "auto",
    run_device: str | None = None,
) -> nn.Module:
    """Loads a ``trust_remote_code`` causal LM with fixes 1-5, on ``device``, in eval mode.

    Args:
        name: registry name (``evabyte`` or ``llama3_byte``): picks the config defaults, the
            optional packages and, for EvaByte, the attention path.
        path: local checkpoint or hub id.
        revision: hub revision.
        dtype: the weights' dtype.
        device: where the model runs.
        attention_impl: EvaByte's attention path (``auto|torch|triton``); ignored otherwise.
        run_device: where the model will run when that is not ``device`` (a trainer loads on
            the CPU and moves the model to its GPU): the attention path is chosen for it.

    Raises:
        TargetLoadError: the remote code imports a package that is not installed, or the
            checkpoint has no remote model class.
        ValueError: ``attention_impl`` cannot run here.
    """
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
