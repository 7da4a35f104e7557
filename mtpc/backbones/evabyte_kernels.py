"""EvaByte's attention path (:func:`resolve_attention_impl`: triton kernels, triton's CPU
interpreter or pure-torch EVA) and what compat does to its triton kernels
(:func:`prepare_eva_kernels`): fix 8 of docs/BACKBONES.md, "Loading real checkpoints"."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from mtpc.backbones.compat import TargetLoadError
from mtpc.choices import ATTENTION_IMPLS
from mtpc.errors import UserError


# ------------------------------------------------------------------- the attention path ----
def triton_available() -> bool:
    """Whether ``triton`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


class AttentionImplError(UserError, ValueError):
    """``model.attention_impl`` names a path that cannot run here (one line, the allowed values)."""


def resolve_attention_impl(
    requested: str, device: str | torch.device, dtype: torch.dtype | str | None = None
) -> str:
    """EvaByte's attention path for ``device``: ``"triton"`` (kernels) or ``"torch"``. ``auto``
    never picks triton's CPU interpreter; ``triton`` on a CPU needs it, in float32 (``dtype``;
    ``None``: not checked). AttentionImplError: the path cannot run ("The kernels on a CPU")."""
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
        from triton import knobs  # triton >= 3.4 (pyproject pins >= 3.7.1)

        if not knobs.runtime.interpret:  # TRITON_INTERPRET, read by triton itself
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


@contextlib.contextmanager
def _kernels_see_gpu(capability: tuple[int, int] | None, cpu_tensors: bool) -> Iterator[None]:
    """Inside the block (or a call it decorates), ``torch.cuda.get_device_capability()``
    returns ``capability`` (unless ``None``) and, with ``cpu_tensors``, every tensor is
    ``is_cuda``: what the host wrappers assert and look up, for triton's interpreter."""
    with contextlib.ExitStack() as patches:
        if capability is not None:
            lookup = mock.patch.object(torch.cuda, "get_device_capability", return_value=capability)
            patches.enter_context(lookup)
        if cpu_tensors:
            every_cuda = property(lambda self: True)
            patches.enter_context(mock.patch.object(torch.Tensor, "is_cuda", every_cuda))
        yield


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


def check_kernel_blocks(
    window: int,
    chunk: int,
    blocks: dict[str, tuple[int, int]],
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
) -> None:
    """Refuses (KernelBlockError) an EVA window / chunk size the kernels' blocks compute wrongly:
    each aggregation program handles rows (or keys) of one window (``offs_w = start_m * BLOCK_M //
    WINDOW_SIZE``), so a ``BLOCK_M`` not dividing it gives wrong attention, unasserted."""
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


def prepare_eva_kernels(
    model_module: ModuleType, config: Any, dtype: torch.dtype, run_device: str | torch.device
) -> dict[str, Any]:
    """Readies EvaByte's remote kernels for a triton-path model (in place, idempotent): the
    interface check, the block gate, the short-row backward and, on a CPU, the interpreter's host
    shim ("What compat does to the remote kernels"). Returns, and stores as ``__mtpc_kernels__``,
    ``{"interpreter": bool, "capability": (major, minor) | None, "blocks": {mode: (M, N)}}``."""
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
    blocks: dict[str, tuple[int, int]] = {}
    if capability is not None:  # {mode: (BLOCK_M, BLOCK_N)} as _get_config picks them there
        with _kernels_see_gpu(capability, cpu_tensors=False):
            get_config = modules["eva_agg_kernel"]._get_config
            blocks = {m: tuple(get_config(dtype, head_dim, m)[:2]) for m in KERNEL_MODES}
        check_kernel_blocks(
            int(config.window_size), int(config.chunk_size), blocks, capability, dtype, head_dim
        )
    wrapped: dict[int, Callable[..., Any]] = {}
    for short, functions in KERNEL_INTERFACE.items():
        for name in functions:
            if name == "_get_config":
                continue
            current = getattr(modules[short], name)
            original = getattr(current, "__mtpc_original__", current)
            new = _empty_rfa_backward(original) if name == "triton_eva_agg_bwd" else original
            if interpreter:  # the host wrapper runs as on a GPU for the duration of a call
                new = _kernels_see_gpu(capability, cpu_tensors=True)(new)
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


def kernels_path(kernels: dict[str, Any] | None) -> str:
    """The triton attention path in words, from :func:`prepare_eva_kernels`'s result:
    ``triton``, or ``triton (CPU interpreter, the blocks of a GPU of capability 9.0)``."""
    if not (kernels and kernels["interpreter"]):
        return "triton"
    capability = ".".join(map(str, kernels["capability"] or ()))
    return f"triton (CPU interpreter, the blocks of a GPU of capability {capability})"
