"""Loading hub remote code (EvaByte, tokenkit's byte Llama) under the pinned transformers 5.x.

The remote code was written for transformers 4.4x; every workaround lives here, numbered by
the failure it fixes (docs/BACKBONES.md, "Loading real checkpoints"): 1 optional kernel
imports, 2 the 4.4x ``rope_scaling`` view, 3 the "default" RoPE initialiser, 4 config keys the
class lacks, 5 non-persistent buffers left empty, 6 removed transformers modules, 7 the
decoder layers' cache keyword ("Following transformers"), 8 EvaByte's triton kernels ("The
kernels on a CPU"). :func:`load_remote_causal_lm` is the only loader of remote code.
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
    """The installed transformers version (``"not installed"`` without it)."""
    try:
        import transformers
    except ImportError:
        return "not installed"
    return str(transformers.__version__)


def cache_keyword(layer_cls: type, default: str | None = None) -> str:
    """The keyword ``layer_cls.forward`` takes its KV cache by (first of :data:`CACHE_KEYWORDS`).

    ``default`` is returned when the signature names none; without one, CacheInterfaceError
    (a ``**kwargs`` catch-all is not trusted: a cache passed there may be dropped).
    """
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
def triton_available() -> bool:
    """Whether ``triton`` can be imported (without importing it)."""
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
    """EvaByte's attention path for ``device``: ``"triton"`` (kernels) or ``"torch"``.

    ``auto`` never picks triton's CPU interpreter; ``triton`` on a CPU needs it, in float32
    (``dtype``; ``None``: not checked). Raises AttentionImplError where the path cannot run
    (docs/BACKBONES.md, "The kernels on a CPU").
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

    def __init__(self, loader: Any, reasons: dict[str, str]) -> None:
        self.loader = loader
        self.reasons = reasons  # optional package -> why it is missing

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        except ModuleNotFoundError as error:
            package = (error.name or "").split(".")[0]
            reason = self.reasons.get(package)
            if reason is None:
                raise
            module.__getattr__ = _unavailable(module.__name__, package, reason)  # type: ignore[method-assign]
            module.__mtpc_unavailable__ = package  # type: ignore[attr-defined]
            message = "%s imports %s (%s): its functions are placeholders"
            log.info(message, module.__name__, package, reason)


class _RemoteModuleFinder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of ``transformers_modules.*`` (remote code) in :class:`_StubOnOptionalImport`."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("transformers_modules.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or spec.submodule_search_locations is not None:
            return spec
        spec.loader = _StubOnOptionalImport(spec.loader, self.reasons)
        return spec


@contextlib.contextmanager
def remote_imports(
    optional: frozenset[str] = frozenset(), blocked: frozenset[str] = frozenset()
) -> Iterator[None]:
    """Imports of remote code inside the block tolerate missing ``optional`` packages.

    A remote module failing on one becomes a placeholder whose functions raise when called.
    ``blocked`` packages are unimportable inside the block, so remote ``try: import ...``
    fallbacks take their pure-torch path.
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


def _forget_remote_package(module_name: str, keep: str) -> None:
    """Drops the remote package of ``module_name`` from ``sys.modules`` (except ``keep``), so
    the next import runs it again (EvaByte picks its attention path at import time)."""
    package = module_name.rpartition(".")[0]
    for name in [n for n in sys.modules if n.startswith(package + ".") and n != keep]:
        del sys.modules[name]
    importlib.invalidate_caches()


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
    """Recomputes ``model``'s non-persistent buffers with its own ``__init__`` (in place);
    returns the names replaced.

    The skeleton is built with ``dtype`` as default dtype (as ``from_pretrained`` does); the
    plain tensor attributes of the buffers' modules (``original_inv_freq``) are copied too.
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
"""The compute capability whose kernel blocks triton's CPU interpreter uses (an H100's);
``MTPC_TRITON_CAPABILITY=8.0`` (an A100) overrides it."""

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
"""The host wrappers of EvaByte's kernels (@ 432331a) compat wraps, with their parameters."""

KERNEL_MODES = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_drfa_kv")  # eva_agg_kernel._get_config's
PREP_KV_BLOCK = 128  # eva_prep_kv_kernel's fixed key block; a chunk must divide it


class KernelInterfaceError(TargetLoadError):
    """EvaByte's remote kernel code no longer has the interface compat wraps (one line)."""


class KernelBlockError(UserError, ValueError):
    """The EVA window / chunk sizes and the kernels' blocks give wrong attention (one line)."""


def kernel_capability() -> tuple[int, int]:
    """The compute capability the interpreter picks blocks for (:data:`INTERPRETER_CAPABILITY`
    or ``MTPC_TRITON_CAPABILITY=<major>.<minor>``; AttentionImplError if malformed)."""
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
    ``None``) and, with ``cpu_tensors``, every tensor is ``is_cuda``: what the host wrappers
    assert and look up, for triton's interpreter. Restored on leaving the outermost block."""
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
    """The remote package's kernel modules named in :data:`KERNEL_INTERFACE`
    (KernelInterfaceError: one is missing or a wrapper's parameters changed)."""
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
    """Refuses (KernelBlockError) an EVA window / chunk size the kernels' blocks compute wrongly.

    Each aggregation program handles rows (or keys) of one window only (``offs_w = start_m *
    BLOCK_M // WINDOW_SIZE``): a ``BLOCK_M`` that does not divide the window gives wrong
    attention and nothing asserts it (docs/BACKBONES.md, "The kernels on a CPU").
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
    """``triton_eva_agg_bwd`` taking ``rfa_k = rfa_v = None`` (a row no longer than a window):
    the remote asserts on ``rfa_k.stride(-1)``, so zero-length RFAs go in (``empty_rfa_kv=1``)."""

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
    model_module: ModuleType, config: Any, dtype: torch.dtype, run_device: str | torch.device
) -> dict[str, Any]:
    """Readies EvaByte's remote kernels for a triton-path model (in place, idempotent): the
    interface check, the block gate, the short-row backward and, on a CPU, the interpreter's
    host shim (docs/BACKBONES.md, "What compat does to the remote kernels").

    Returns ``{"interpreter": bool, "capability": (major, minor) | None, "blocks": {mode: (M,
    N)}}``, also stored as the model module's ``__mtpc_kernels__``.
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
    capability: tuple[int, int] | None = None  # a GPU run prepared without a GPU: checked there
    if interpreter:
        capability = kernel_capability()
    elif torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(torch.device(run_device)))  # type: ignore[assignment]
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
    """Whether the remote kernels were imported under triton's interpreter (``None``: no
    kernel module with a triton function)."""
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
    """Loads a ``trust_remote_code`` causal LM with fixes 1-6 and 8, on ``device``, in eval mode.

    ``name`` (``evabyte`` | ``llama3_byte``) picks the config defaults, optional packages and
    EvaByte's attention path, chosen for ``run_device`` (default ``device``). Raises
    TargetLoadError (a missing package, no remote model class) or AttentionImplError.
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
