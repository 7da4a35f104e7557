"""GPU self-check: what only a GPU can show, in a few minutes, before a long job.

    python scripts/check_gpu.py                        # one GPU (two-GPU part when 2 are visible)
    python scripts/check_gpu.py --evabyte-code DIR     # + EvaByte's triton kernels vs torch
    python scripts/check_gpu.py --device cpu           # the same checks on CPU (the test suite)
    python scripts/check_gpu.py --device cpu --evabyte-code DIR   # EvaByte's kernels on CPU
    python scripts/check_gpu.py --device cpu --compile aot_eager  # + the compiled engine's lines
    python scripts/check_gpu.py -- model.dtype=bfloat16 lora.layers=2   # training overrides

One line per check, ``PASS name: detail``, ``FAIL name: detail`` or ``SKIP name: why``;
every check runs inside the reporter (a crash is a FAIL line, never a traceback) and the exit
status is 1 when any check fails. Checks (docs/TRAINING.md, "GPU self-check"):

* ``device``: the device, torch / CUDA versions, bf16 support, visible GPUs.
* ``load[<target>]``: the target loads (the tiny EvaByte checkpoint is built here too), with
  the attention path it runs.
* ``eva_triton_vs_torch``: EvaByte's real remote code (``--evabyte-code``, a directory with
  ``evabyte_hf/*.py``) as a tiny random checkpoint (EVA window 128, chunk 4: shapes every
  GPU's block table accepts), loaded once with ``model.attention_impl=triton`` and once with
  ``torch``: the logits of a 160-byte prompt (past one window, so the window compression
  ``triton_eva_prep_kv_fwd`` runs) agree.
* ``eva_train_triton_vs_torch``: a LoRA k = 1 objective step of the tiny EvaByte on rows
  shorter than one window (no compressed chunk yet: a backward the remote code cannot take
  without ``mtpc.backbones.evabyte_kernels``) and on rows longer than one: the loss and gradients of
  the triton path equal the torch path's.
* ``one_pass_verify[<target>]``: a drafted window run in one cached trunk pass gives the
  logits of the same positions fed one per pass (how every cycle verifies), up to EvaByte's
  window boundary and past it.
* ``greedy_spec_equals_ar[<target>]``: greedy self-speculative output through
  ``mtpc.generate`` equals autoregressive output token for token (the prompt and the
  generation cross EvaByte's first window boundary).
* ``ar_vs_hf_generate[<target>]``: our autoregressive decoding gives the target's own
  ``generate`` output, and its tokens per second against ``generate``'s
  (fails below ``--min-ar-speed``).
* ``compiled_ar_equals_eager[<target>]``, ``compiled_chain_equals_eager[<target>]``: greedy
  autoregressive / speculative decoding on the static, compiled engine (``mtpc.generate(...,
  compile=--compile)``: inductor on CUDA, ``mode="reduce-overhead"``, CUDA graphs) against
  eager decoding, at B = 1 and B = 8: 10 prompts of 1 to 120 ids and a stop id that ends about
  half the rows early (rows replaced). float32: identical tokens; bf16: each row up to its
  first flip, which the tie rule of ``greedy_spec_equals_ar`` must explain (counted).
* ``compiled_sampled_equals_eager[<target>]``: the same, sampled (each row its seed), both
  methods: identical tokens in float32 (SKIP in bf16).
* ``compiled_no_recompile[<target>]``: after a warm-up, five prompts of new lengths (alone and
  at B = 8) decode under dynamo's ``error_on_recompile``: no new graph, no fallback.
  SKIP with ``--compile none`` (the CPU default) or ``supports_compile``'s refusal.
* ``train[<strategy>]``: three optimizer steps of the draft (LoRA on the last layer): the
  attention path, trainable dtypes (all float32), a finite loss, every trainable tensor
  moved, peak memory, step times, the checkpoint's size and that it holds only trained
  weights. ``single`` runs in this process; ``ddp`` and ``fsdp`` run ``train.py`` on two
  processes when two GPUs are visible (``--two-process`` forces it, on CPU with gloo).

Targets: the bundled tiny target, and the tiny EvaByte of the real code with
``--evabyte-code`` (on the triton kernels on a GPU). With ``--device cpu``, triton installed
and ``--evabyte-code``, the script sets ``TRITON_INTERPRET=1`` before triton is imported and
the EvaByte checks run the real kernels through triton's CPU interpreter (float32, the
blocks of an H100: ``mtpc.backbones.evabyte_kernels.INTERPRETER_CAPABILITY``). ``--break-kernel``
forces a forward ``BLOCK_M`` twice the EVA window into the kernels after each load (past the
gate that refuses it at load time): the self-test of the FAIL path. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

import mtpc
from mtpc.backbones import load_backbone

if TYPE_CHECKING:  # mtpc.model imports triton (through peft): only after main() set the mode
    from mtpc.model import MTPCModel

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("single", "ddp", "fsdp")
TRAIN_OVERRIDES = [
    "circuit=btree", "circuit.window=4", "circuit.rank=2", "lora.layers=1",
    "data.num_rows=300", "data.seq_len=96", "data.batch_size=2", "loss.chunk_size=128",
    "logger=none", "trainer.max_steps=3", "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "validate_before_training=false",
]  # fmt: skip
"""The three-step run of every ``train[...]`` check (tiny data; the model is ``model=``)."""


class Report:
    """Collects and prints one line per check."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, status: str, name: str, detail: str) -> None:
        line = f"{status} {name}: {detail}"
        self.lines.append(line)
        print(line, flush=True)

    @property
    def failed(self) -> bool:
        return any(line.startswith("FAIL") for line in self.lines)

    def run(self, name: str, check: Callable[[], tuple[bool | None, str]]) -> None:
        """Runs ``check`` (``(True|False|None for SKIP, detail)``); an exception is a FAIL."""
        try:
            ok, detail = check()
        except Exception as err:  # a crash is a failed check, reported in one line
            ok, detail = False, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        self.add("SKIP" if ok is None else "PASS" if ok else "FAIL", name, detail)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory(device: str) -> str:
    from mtpc.evaluation.run import peak_memory_mb  # here: it imports triton (see above)

    kind = "CUDA, allocated" if device.startswith("cuda") else "process RSS"
    return f"{peak_memory_mb(device):.0f} MiB ({kind})"


# -- targets ------------------------------------------------------------------------------------
def _remote_code_tools() -> Any:
    """scripts/check_remote_code.py (builds tiny checkpoints of the real remote code)."""
    path = REPO / "scripts" / "check_remote_code.py"
    spec = importlib.util.spec_from_file_location("mtpc_check_remote_code", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EVA_TINY = {"window_size": 128, "chunk_size": 4, "num_hidden_layers": 2}
"""The tiny EvaByte's EVA sizes (head_dim 16): every GPU's block table divides a window of 128
and its 32 chunks (``mtpc.backbones.evabyte_kernels.check_kernel_blocks``)."""


def tiny_evabyte_checkpoint(code: Path, root: Path) -> Path:
    """A tiny random checkpoint of EvaByte's real code (:data:`EVA_TINY`, 2 layers)."""
    tools = _remote_code_tools()
    source = code / "evabyte_hf" if (code / "evabyte_hf").is_dir() else code
    folder, _ = tools.write_checkpoint(
        "evabyte", source, "default", root, max_position_embeddings=512, **EVA_TINY
    )
    return Path(folder)


def interpreter_mode(args: argparse.Namespace) -> bool:
    """``--device cpu`` in float32 with triton installed and ``--evabyte-code``: the EvaByte
    checks run the kernels through triton's CPU interpreter (``main`` sets
    ``TRITON_INTERPRET=1``)."""
    return (
        not args.device.startswith("cuda")
        and args.dtype == "float32"
        and args.evabyte_code is not None
        and importlib.util.find_spec("triton") is not None
    )


def eva_impl(args: argparse.Namespace) -> str:
    """EvaByte's ``model.attention_impl`` here: ``auto`` on a GPU (the kernels when triton is
    installed), ``triton`` in :func:`interpreter_mode`, else ``torch``."""
    if args.device.startswith("cuda"):
        return "auto"
    return "triton" if interpreter_mode(args) else "torch"


def break_kernel(backbone: Any) -> None:
    """``--break-kernel``: the loaded model's ``eva_agg_kernel._get_config`` gives a forward
    ``BLOCK_M`` twice the EVA window from now on (what the load-time gate refuses)."""
    package = backbone.remote.__name__.rpartition(".")[0]
    kernels = sys.modules[f"{package}.eva_agg_kernel"]
    original = getattr(kernels._get_config, "__wrapped__", kernels._get_config)
    wrong = 2 * backbone.window_size

    def broken(dtype: Any, head_dim: int, mode: str) -> tuple[int, int, int, int]:
        block_m, block_n, warps, stages = original(dtype, head_dim, mode)
        return (wrong if mode == "fwd" else block_m), block_n, warps, stages

    broken.__wrapped__ = original  # type: ignore[attr-defined]
    kernels._get_config = broken


def load_target(
    name: str, path: str | None, args: argparse.Namespace, impl: str | None = None
) -> Any:
    """The backbone of a target (EvaByte on ``impl``, default :func:`eva_impl`)."""
    kwargs = {"attention_impl": impl or eva_impl(args)} if name == "evabyte" else {}
    backbone = load_backbone(name, path=path, dtype=args.dtype, device=args.device, **kwargs)
    if args.break_kernel and getattr(backbone, "use_triton", False):
        break_kernel(backbone)
    return backbone


def draft_model(name: str, path: str | None, args: argparse.Namespace) -> MTPCModel:
    """The target with an untrained btree head (n = 4, r = 2) and LoRA on its last layer."""
    from mtpc.model import MTPCModel

    return MTPCModel.from_backbone(load_target(name, path, args), "btree", 4, 2, lora_layers=1)


def attention_path(model: MTPCModel) -> str:
    """The attention the target's layers run (EvaByte: its EVA path; else transformers')."""
    return getattr(model.backbone, "attention_path", None) or str(
        getattr(model.backbone.hf_model.config, "_attn_implementation", "?")
    )


def _prompt(model: MTPCModel, length: int, seed: int = 0) -> list[int]:
    from mtpc.backbones.codecs import get_codec

    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs. "
    if model.backbone.codec is not None:
        return get_codec(model.backbone.codec).encode(text * 4)[:length]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.backbone.vocab_size, (length,), generator=g).tolist()


def _close(a: torch.Tensor, b: torch.Tensor, args: argparse.Namespace) -> tuple[bool, str]:
    """Logits that agree: :func:`_close_values` of their max |diff| and scale."""
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))
    return _close_values(float((a - b).abs().max()), scale, args)


def _close_values(diff: float, scale: float, args: argparse.Namespace) -> tuple[bool, str]:
    """A max |diff| of logits that agrees: within ``--tolerance`` in float32 (IEEE float32
    everywhere, so only summation order differs); in bf16 within ``--bf16-rtol`` of the
    logits' scale ``scale`` (bf16 keeps 8 bits: a logit of 16 is rounded to steps of 0.06)."""
    if args.dtype == "float32":
        return diff <= args.tolerance, f"max |diff| {diff:.2e} (tolerance {args.tolerance:.0e})"
    tol = args.bf16_rtol * max(scale, 1.0)
    return (
        diff <= tol,
        f"max |diff| {diff:.2e} (tolerance {tol:.1e} = {args.bf16_rtol} x max |logit|)",
    )


# -- checks -------------------------------------------------------------------------------------
def check_device(args: argparse.Namespace) -> tuple[bool | None, str]:
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return False, "--device cuda but torch sees no CUDA GPU (use --device cpu)"
        props = torch.cuda.get_device_properties(0)
        return True, (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} "
            f"visible, torch {torch.__version__}, CUDA {torch.version.cuda}, bf16 "
            f"{torch.cuda.is_bf16_supported()}; float32 matmuls: torch "
            f"{'TF32' if torch.backends.cuda.matmul.allow_tf32 else 'IEEE'}, triton tl.dot "
            f"{os.environ.get('TRITON_F32_DEFAULT', 'tf32 (its default)')}"
        )
    return True, f"cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def _eva_skip(args: argparse.Namespace) -> str | None:
    """Why the EvaByte kernel checks cannot run here (``None``: they can)."""
    if not args.evabyte_code:
        return "no EvaByte remote code (--evabyte-code DIR with evabyte_hf/*.py)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _logits(backbone: Any, ids: torch.Tensor) -> torch.Tensor:
    """STP logits of a cache-free run of every layer (1, T) -> (T, V) float32."""
    hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)
    return backbone.stp_logits(backbone.norm(hidden))[0].float()


def eva_logits(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Logits of a prompt past one EVA window on the triton path and on the torch path: their
    max |diff|, the larger max |logit|, the share of equal argmaxes and what ran."""
    from mtpc.model import MTPCModel

    backbones = {impl: load_target("evabyte", path, args, impl) for impl in ("triton", "torch")}
    length = backbones["torch"].window_size + 32  # past one window: the compression kernel runs
    model = MTPCModel.from_backbone(backbones["torch"], "ff", 1, 1)
    ids = torch.tensor([_prompt(model, length)], device=args.device)
    with torch.no_grad():
        logits = {impl: _logits(b, ids) for impl, b in backbones.items()}  # (T, V) each
    a, b = logits["triton"], logits["torch"]
    return {
        "diff": float((a - b).abs().max()),
        "scale": float(torch.maximum(a.abs().max(), b.abs().max())),
        "same_argmax": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "what": f"{length} bytes (EVA window {backbones['torch'].window_size}, chunk "
        f"{EVA_TINY['chunk_size']}; {backbones['triton'].attention_path})",
    }


def check_eva_triton(args: argparse.Namespace, path: str) -> tuple[bool | None, str]:
    """Logits of a prompt past one EVA window, triton path vs torch path (float32: IEEE
    ``tl.dot``, ``main`` sets ``TRITON_F32_DEFAULT=ieee``)."""
    found = eva_logits(args, path)
    ok, detail = _close_values(found["diff"], found["scale"], args)
    return ok, (
        f"{found['what']}, triton vs torch logits: {detail}; same argmax {found['same_argmax']:.0%}"
    )


TF32_CHILD = "--tf32-child"
"""The hidden flag of the child process that measures :func:`eva_logits` with TF32."""


def check_eva_tf32(args: argparse.Namespace, path: str) -> tuple[bool | None, str]:
    """float32 on a GPU: the triton path's error with ``tl.dot``'s default input precision
    (TF32: 10 mantissa bits), what a float32 run gets without ``TRITON_F32_DEFAULT=ieee``.
    Measured in a child process (triton keeps the kernels it compiled per process). TF32
    rounds each product's inputs more finely than bf16 (7 bits), so it is held to the bf16
    tolerance: an error above it is not TF32's rounding."""
    if not args.device.startswith("cuda"):
        return None, "TF32 exists on tensor-core GPUs only (the CPU interpreter computes IEEE)"
    if args.dtype != "float32":
        return None, f"{args.dtype} inputs: tl.dot does not round them to TF32"
    env = {**os.environ, "TRITON_F32_DEFAULT": "tf32"}
    command = [sys.executable, str(Path(__file__).resolve()), TF32_CHILD, path,
               "--device", args.device, "--dtype", "float32"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        return False, f"the TF32 child exited {result.returncode}: {result.stderr.strip()[-300:]}"
    found = json.loads(result.stdout.strip().splitlines()[-1])
    tol = args.bf16_rtol * max(found["scale"], 1.0)
    return found["diff"] <= tol, (
        f"{found['what']}, TF32 triton vs IEEE torch logits: max |diff| {found['diff']:.2e} "
        f"(tolerance {tol:.1e} = bf16's {args.bf16_rtol} x max |logit|); same argmax "
        f"{found['same_argmax']:.0%}"
    )


def eva_objective_step(
    model: MTPCModel, ids: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """One LoRA-stage objective (paper Eq. 4 over every position of ``ids`` (B, T)) and its
    backward: the loss and the gradient of every trainable tensor (head and LoRA)."""
    from mtpc.data.windows import make_windows
    from mtpc.training.module import MTPCLightningModule

    module = MTPCLightningModule(model, chunk_size=256)
    n = module.head.window
    documents = torch.zeros_like(ids)
    targets, target_mask, window_mask = make_windows(
        ids, documents, torch.ones_like(ids, dtype=torch.bool), n, pad_id=0
    )
    batch = {"input_ids": ids, "targets": targets, "target_mask": target_mask,
             "window_mask": window_mask}  # fmt: skip
    module.zero_grad()
    loss = module._objective(batch)[0].loss
    loss.backward()
    grads = {
        name: p.grad.detach().float().clone()
        for name, p in module.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return float(loss), grads


def eva_lora_model(backbone: Any, seed: int = 0) -> MTPCModel:
    """The backbone with a btree head (n = 4, r = 2) and random LoRA weights on its last layer
    (peft starts B at zero: random ones give the LoRA A matrices a gradient too)."""
    from mtpc.model import MTPCModel

    torch.manual_seed(seed)
    model = MTPCModel.from_backbone(backbone, "btree", 4, 2, lora_layers=1)
    with torch.no_grad():
        for p in model.backbone.lora.parameters():
            p.normal_(0, 0.05)
    return model


def compare_objective_steps(
    args: argparse.Namespace, path: str, lengths: Sequence[int], rows: int = 2
) -> dict[int, dict[str, float]]:
    """:func:`eva_objective_step` on the triton and the torch path, for rows of each length:
    ``{length: {"loss": |diff|, "grad": max |diff| / max |grad|, "tensors": count}}``."""
    found: dict[int, dict[str, float]] = {}
    models = {impl: eva_lora_model(load_target("evabyte", path, args, impl)) for impl in
              ("triton", "torch")}  # fmt: skip
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(64, 320, (rows, length), generator=g).to(args.device)
        steps = {impl: eva_objective_step(m, ids) for impl, m in models.items()}
        (loss_a, grads_a), (loss_b, grads_b) = steps["triton"], steps["torch"]
        if sorted(grads_a) != sorted(grads_b) or not grads_a:
            raise AssertionError(f"trainable tensors differ: {len(grads_a)} vs {len(grads_b)}")
        scale = max(float(g.abs().max()) for g in grads_b.values())
        diff = max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_b)
        found[length] = {"loss": abs(loss_a - loss_b), "grad": diff / max(scale, 1e-30),
                         "tensors": float(len(grads_b))}  # fmt: skip
    return found


def check_eva_train(args: argparse.Namespace, path: str) -> tuple[bool | None, str]:
    """LoRA k = 1 objective steps, triton vs torch, on rows shorter and longer than a window."""
    window = EVA_TINY["window_size"]
    found = compare_objective_steps(args, path, (window - 28, window + 32))
    tol = args.tolerance if args.dtype == "float32" else args.bf16_rtol
    ok = all(v["loss"] <= tol and v["grad"] <= tol for v in found.values())
    parts = [
        f"rows of {length} bytes: |loss diff| {v['loss']:.1e}, max |grad diff| {v['grad']:.1e} "
        f"of max |grad| ({v['tensors']:.0f} tensors)"
        for length, v in found.items()
    ]
    return ok, f"LoRA k=1, triton vs torch (tolerance {tol:.0e}): {'; '.join(parts)}"


def one_pass_logits(
    backbone: Any, ids: torch.Tensor, start: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The STP logits ``(count, V)`` float32 of positions ``start..start+count-1`` of ``ids``
    ``(1, L)`` after a cached prefill of ``ids[:, :start]``, two ways: in as few cached passes
    as the backbone verifies exactly (one up to EvaByte's window boundary, then the rest: how
    every cycle verifies) and one position per pass (how the autoregressive step runs)."""
    layers = backbone.num_layers
    cache = backbone.new_cache(0, layers)

    def logits(chunk: torch.Tensor, into: Any) -> torch.Tensor:
        hidden = backbone.run_layers(backbone.embed(chunk), 0, layers, cache=into)
        return backbone.stp_logits(backbone.norm(hidden))[0].float()  # (len, V)

    with torch.no_grad():
        logits(ids[:, :start], cache)
        sequential = cache.clone()
        passes, at, end = [], start, start + count
        while at < end:
            span = backbone.one_pass_span(at, end - at)  # to EvaByte's window boundary
            passes.append(logits(ids[:, at : at + span], cache))
            at += span
        one = [logits(ids[:, i : i + 1], sequential) for i in range(start, end)]
    return torch.cat(passes), torch.cat(one)


def check_one_pass(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    """After a prefill of 249 positions (past EvaByte's first window of 128), a verify pass up
    to the next window boundary, then one past it, each against the same positions fed one
    per pass."""
    backbone = model.backbone
    ids = torch.tensor([_prompt(model, 280, seed=2)], device=args.device)  # (1, 280)
    start = 249
    span = backbone.one_pass_span(start, 16)  # to EvaByte's window boundary; 16 elsewhere
    one, seq = one_pass_logits(backbone, ids, start, span + 5)  # 5 past the boundary
    ok, detail = _close(one, seq, args)
    return ok, (
        f"{span} positions after {start} in one pass, then 5 after them, vs one per pass: "
        f"{detail} ({attention_path(model)})"
    )


NOISE_POSITIONS = 16
"""Positions before a greedy flip over which the one-pass vs one-token noise is measured."""


def flip_explained(
    logits: torch.Tensor, ar_token: int, sd_token: int, noise: float
) -> float | None:
    """Whether a greedy flip is rounding: the one-token logits ``logits`` ``(V,)`` chose
    ``ar_token``, a one-pass run of the same positions chose ``sd_token``. If the one-pass
    logits are ``logits + e`` with every ``|e| <= noise``, a flip needs
    ``logits[ar] - logits[sd] <= e[sd] - e[ar] <= 2 * noise``; a wider gap is a wrong token,
    not a tie. Returns the gap when the flip is explained, else None."""
    gap = float(logits[ar_token] - logits[sd_token])
    return gap if gap <= 2.0 * noise else None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


class Tie(NamedTuple):
    """A greedy flip weighed by the tie rule (:func:`tie_at`)."""

    gap: float  # the one-token logit of the reference's token minus the other's
    noise: float  # max |one pass - one token| over the positions before the flip
    explained: bool  # gap <= 2 x noise (:func:`flip_explained`): a tie, not a wrong token

    def __str__(self) -> str:
        sign = "<=" if self.explained else ">"
        return f"gap {self.gap:.2g} {sign} 2 x noise {self.noise:.2g}"


def tie_at(model: MTPCModel, context: Sequence[int], ref: int, other: int,
           args: argparse.Namespace) -> Tie:  # fmt: skip
    """The tie rule at a greedy flip after ``context``: the reference picked ``ref``, the
    other path ``other``; the one-pass vs one-token noise is measured over the
    :data:`NOISE_POSITIONS` positions before it (:func:`one_pass_logits`). After a context of
    one id there is no cached position to measure it on: noise 0, only an exact tie."""
    ids = torch.tensor([list(context)], device=args.device)  # (1, L)
    if ids.shape[1] < 2:
        with torch.no_grad():
            seq, noise = _logits(model.backbone, ids), 0.0  # (1, V)
    else:
        start = max(1, ids.shape[1] - NOISE_POSITIONS)
        one, seq = one_pass_logits(model.backbone, ids, start, ids.shape[1] - start)
        noise = float((one - seq).abs().max())
    gap = float(seq[-1][ref] - seq[-1][other])
    return Tie(gap, noise, flip_explained(seq[-1], ref, other, noise) is not None)


def _shown(ties: Sequence[str]) -> str:
    """The first three counted ties, in brackets ("" when none)."""
    return f" ({'; '.join(ties[:3])}{', ...' if len(ties) > 3 else ''})" if ties else ""


def check_greedy(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    """Greedy speculative output equals autoregressive output, token for token in float32.
    In half precision the one-pass verifier and the one-token step run different kernels: a
    flip where the target's top two are closer than twice the measured logit noise of the two
    paths (:func:`flip_explained`) is a tie, counted; decoding then goes on from the
    speculative token, and any flip outside the noise FAILs."""
    prompt = _prompt(model, 230)  # the prefill and, with --new-tokens 48, the generation
    # cross a boundary of EvaByte's window of 128
    exact = args.dtype == "float32"
    context, left, ties, cycles, accepted = list(prompt), args.new_tokens, [], 0, 0
    while left > 0:
        kw = {"max_new_tokens": left, "greedy": True, "suppress_eos": True}
        ar = mtpc.generate(model, context, method="autoregressive", **kw)
        sd = mtpc.generate(model, context, method="speculative", **kw)
        cycles, accepted = cycles + len(sd.accepted), accepted + sum(sd.accepted)
        first = _first_difference(sd.tokens, ar.tokens)
        if first is None:
            break
        at = len(context) - len(prompt) + first  # the flip's index in the generation
        if exact:
            return (
                False,
                f"float32 must be exact: first difference at token {at} ({attention_path(model)})",
            )
        tie = tie_at(model, context + list(ar.tokens[:first]), ar.tokens[first],
                     sd.tokens[first], args)  # fmt: skip
        if not tie.explained:
            return False, (
                f"token {at}: speculative {sd.tokens[first]} vs autoregressive "
                f"{ar.tokens[first]}, logit gap {tie.gap:.3g} > 2 x one-pass noise "
                f"{tie.noise:.3g}: a wrong token, not a {args.dtype} tie ({attention_path(model)})"
            )
        ties.append(f"token {at}: {tie}")
        context += list(sd.tokens[: first + 1])  # both are the target's pick within rounding
        left -= first + 1
    rule = (
        "exact (float32)"
        if exact
        else "identical"
        if not ties
        else f"equal up to {len(ties)} {args.dtype} tie(s)"
    )
    return True, (
        f"{len(prompt)}-byte prompt, {args.new_tokens} tokens, speculative == autoregressive: "
        f"{rule}{_shown(ties)}; {accepted / max(cycles, 1):.2f} accepted drafts per cycle "
        f"(untrained head; {attention_path(model)})"
    )


def check_ar_speed(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    hf = model.backbone.hf_model
    if not hasattr(hf, "generate"):
        return None, f"{type(hf).__name__} has no generate()"
    prompt = _prompt(model, 24)
    n = args.new_tokens
    ids = torch.tensor([prompt], device=args.device)
    ours = mtpc.generate(model, prompt, n, method="autoregressive", suppress_eos=True)  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    ours = mtpc.generate(model, prompt, n, method="autoregressive", suppress_eos=True)
    _sync(args.device)
    ours_s = time.perf_counter() - start
    gen = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "use_cache": True}
    with torch.no_grad():
        hf.generate(ids, **gen)
        _sync(args.device)
        start = time.perf_counter()
        theirs = hf.generate(ids, **gen)[0, len(prompt) :].tolist()
        _sync(args.device)
    hf_s = time.perf_counter() - start
    same = list(ours.tokens) == theirs
    ratio = hf_s / max(ours_s, 1e-9)  # our tokens/s over generate's
    detail = (
        f"{n} tokens: ours {n / ours_s:.0f} tok/s, generate() {n / hf_s:.0f} tok/s "
        f"(x{ratio:.2f}, minimum x{args.min_ar_speed}); same tokens {same}"
    )
    return same and ratio >= args.min_ar_speed, detail


# -- the compiled decode engine (mtpc.generate(..., compile=...), mtpc.decoding.static) --------
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "none")
"""``--compile``: the compiled lines' backend. inductor (the default on CUDA) is what
``compile=True`` runs there: ``mode="reduce-overhead"``, CUDA graphs; aot_eager and eager trace
the same one graph without generating code (aot_eager also decomposes it: the CPU smoke
run's); none (the default on a CPU): SKIP."""

COMPILED_LINES = ("compiled_ar_equals_eager", "compiled_chain_equals_eager",
                  "compiled_sampled_equals_eager", "compiled_no_recompile")  # fmt: skip
"""The compiled engine's lines, one set per target (``name[<target>]``)."""

COMPILED_LENGTHS = (3, 9, 40, 17, 70, 5, 33, 1, 24, 120)
"""The prompts of the equality lines: 10 lengths (1 to 4 prefill chunks; 120 ids and the new
tokens cross the tiny EvaByte's window of 128), so at B = 8 two rows take the places of
finished ones."""

NEW_LENGTHS = (2, 31, 45, 64, 130)
"""``compiled_no_recompile``'s prompts: lengths no line decoded before (1 to 5 prefill chunks;
130: past the tiny EvaByte's window); at B = 8 with :data:`NEW_FILL`, three more."""

NEW_FILL = (11, 58, 90)

SIZES = (1, 8)
"""The compiled lines' batch sizes: an engine each (its graphs shared by every line)."""

COMPILED_NEW = 24
"""New tokens per row in the compiled lines, at most (``--new-tokens`` below it): enough for
each row's stop, the chain's rewinds and the replaced rows; more would only slow the CPU run
(a GPU's time goes to compiling). The longest prompt, the tokens and a verify window stay in
one capacity bucket (256): no line compiles a graph of another bucket."""


def compile_refusal(model: MTPCModel, args: argparse.Namespace) -> str | None:
    """Why the compiled lines do not run (``--compile none``, the engine's own refusal)."""
    if args.compile == "none":
        return "--compile none (the default on a CPU; --compile aot_eager runs these lines)"
    from mtpc.decoding import static

    return static.supports_compile(model, args.compile)


def _prompts(model: MTPCModel, lengths: Sequence[int]) -> list[list[int]]:
    """One prompt per length, each a different stretch of :func:`_prompt`'s ids."""
    ids = _prompt(model, 2 * max(lengths))
    return [ids[(13 * i) % (len(ids) - n + 1) :][:n] for i, n in enumerate(lengths)]


def decode_compiled(
    model: MTPCModel, prompts: Any, args: argparse.Namespace, **kw: Any
) -> tuple[list[Any], str | None]:
    """``mtpc.generate(model, prompts, compile=--compile, **kw)``'s results, and why they are
    not the compiled engine's (None: they are): a fallback warning, an engine whose compiled
    step ``failed``, a result whose ``engine`` is not ``compiled``."""
    import warnings

    from mtpc.decoding import static

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        out = mtpc.generate(model, prompts, compile=args.compile, **kw)
    results = out if isinstance(out, list) else [out]
    engines = vars(model).get(static.ENGINES_ATTRIBUTE, {}).values()
    why = [str(w.message) for w in caught if "decode step failed" in str(w.message)]
    why += [f"engine failed: {e.failed}" for e in engines if e.failed is not None]
    why += [f"results' engine {e!r}" for e in sorted({r.engine for r in results} - {"compiled"})]
    return results, "; ".join(why)[:300] or None


def stop_id(runs: Sequence[Sequence[int]]) -> int | None:
    """A stop id that ends about half the rows early: of the ids in ``runs`` (rows decoded
    without stop ids), the one met before a row's last token in the share of rows nearest one
    half (then: met latest on average, then the smallest id)."""
    firsts: dict[int, list[int]] = {}  # id -> its first index in each row that has it
    for tokens in runs:
        seen: dict[int, int] = {}
        for i, token in enumerate(tokens[:-1]):
            seen.setdefault(token, i)
        for token, i in seen.items():
            firsts.setdefault(token, []).append(i)
    rows = len(runs)
    return min(firsts, key=lambda t: (abs(2 * len(firsts[t]) - rows),
                                      -sum(firsts[t]) / len(firsts[t]), t), default=None)  # fmt: skip


def compare_compiled(
    model: MTPCModel, args: argparse.Namespace, method: str, greedy: bool
) -> tuple[bool, str]:
    """``method`` (greedy or sampled, each row its seed) eagerly and on the compiled engine,
    the prompts of :data:`COMPILED_LENGTHS` at each of :data:`SIZES`, with a stop id that ends
    about half the rows early (:func:`stop_id`): the same tokens, row by row. float32 (and
    any sampled run): identical. Greedy in half precision: each row up to its first flip,
    which the tie rule (:func:`tie_at`) must explain, counted; the rest of that row is not
    compared (after a tie the two rows go on from different tokens)."""
    prompts = _prompts(model, COMPILED_LENGTHS)
    kw = {"max_new_tokens": min(args.new_tokens, COMPILED_NEW), "method": method,
          "greedy": greedy, "seed": list(range(len(prompts)))}  # fmt: skip
    free = mtpc.generate(model, prompts, batch_size=max(SIZES), stop_ids=(), **kw)
    stop = stop_id([r.tokens for r in free])
    kw["stop_ids"] = () if stop is None else (stop,)
    exact = args.dtype == "float32" or not greedy
    kind = "greedy" if greedy else "sampled"
    ties: list[str] = []
    for size in SIZES:
        eager = mtpc.generate(model, prompts, batch_size=size, **kw)
        compiled, fallback = decode_compiled(model, prompts, args, batch_size=size, **kw)
        if fallback is not None:
            return False, f"B={size}: not the compiled engine: {fallback}"
        for row, (e, c) in enumerate(zip(eager, compiled, strict=True)):
            first = _first_difference(c.tokens, e.tokens)
            if first is None and len(c.tokens) == len(e.tokens):
                continue
            where = f"B={size} row {row} ({len(prompts[row])}-id prompt)"
            if first is None:
                return False, f"{where}: {len(c.tokens)} compiled tokens vs {len(e.tokens)} eager"
            found = f"{where} token {first}: compiled {c.tokens[first]} vs eager {e.tokens[first]}"
            if exact:
                return False, f"{found}: {args.dtype} {kind} must be exact"
            tie = tie_at(model, prompts[row] + list(e.tokens[:first]), e.tokens[first],
                         c.tokens[first], args)  # fmt: skip
            if not tie.explained:
                return False, f"{found}, logit {tie}: a wrong token, not a {args.dtype} tie"
            ties.append(f"{where} token {first}: {tie}")
    stopped = sum(r.stopped for r in eager)
    cycles = [a < d for r in compiled for a, d in zip(r.accepted, r.drafted, strict=False)]
    rewound = (
        f", {sum(cycles)} of {len(cycles)} cycles rewound" if method != "autoregressive" else ""
    )
    rule = (
        "identical"
        if not ties
        else f"equal up to the first flip of each row, {len(ties)} {args.dtype} tie(s)"
        f"{_shown(ties)}"
    )
    return True, (
        f"{len(prompts)} prompts of {min(COMPILED_LENGTHS)}-{max(COMPILED_LENGTHS)} ids, "
        f"{kw['max_new_tokens']} tokens, stop id {stop} ending {stopped} rows early{rewound}; B="
        f"{' and B='.join(map(str, SIZES))} ({len(prompts) - max(SIZES)} rows replaced): tokens "
        f"{rule} ({args.compile}; {attention_path(model)})"
    )


def check_compiled_sampled(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    """Sampled autoregressive and speculative decoding, compiled vs eager: identical tokens."""
    if args.dtype != "float32":
        return None, (
            f"{args.dtype}: a rounding flip changes every later draw, and the tie rule weighs "
            "greedy flips only (--dtype float32 runs this line)"
        )
    parts = []
    for method in ("autoregressive", "speculative"):
        ok, detail = compare_compiled(model, args, method, greedy=False)
        if not ok:
            return False, f"{method}: {detail}"
        parts.append(f"{method}: {detail}")
    return True, "; ".join(parts)


def check_no_recompile(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    """After a warm-up decode at each of :data:`SIZES` (autoregressive and speculative), five
    prompts of new lengths, each alone and with three more at B = 8, decode with dynamo's
    ``error_on_recompile``: no new graph, no fallback, every result ``compiled``."""
    from torch._dynamo.utils import counters

    methods = ("autoregressive", "speculative")
    warm = _prompts(model, COMPILED_LENGTHS[: max(SIZES)])
    why = []
    for method in methods:
        for size in SIZES:
            kw = {"method": method, "batch_size": size, "max_new_tokens": 8, "stop_ids": ()}
            why.append(decode_compiled(model, warm[:size], args, **kw)[1])
    if any(why):
        return False, f"the warm-up did not run compiled: {next(w for w in why if w)}"
    before = int(counters["stats"]["unique_graphs"])
    fresh = _prompts(model, NEW_LENGTHS + NEW_FILL)
    kw = {"max_new_tokens": min(args.new_tokens, COMPILED_NEW), "stop_ids": ()}
    calls: list[tuple[Any, int]] = [(p, 1) for p in fresh[: len(NEW_LENGTHS)]]
    calls.append((fresh, max(SIZES)))
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompilation raises: the
        for method in methods:  # step falls back to eager, with the warning decode_compiled sees
            for prompts, size in calls:
                why.append(decode_compiled(model, prompts, args, method=method, batch_size=size,
                                           **kw)[1])  # fmt: skip
    graphs = int(counters["stats"]["unique_graphs"]) - before
    problems = [w for w in why if w] + ([f"{graphs} new graph(s)"] if graphs else [])
    detail = (
        f"after a warm-up at B={' and B='.join(map(str, SIZES))}, {len(NEW_LENGTHS)} prompts of "
        f"new lengths ({', '.join(map(str, NEW_LENGTHS))} ids) alone and with {len(NEW_FILL)} "
        f"more at B={max(SIZES)}, autoregressive and speculative, {kw['max_new_tokens']} tokens: "
    )
    if problems:
        return False, detail + "; ".join(problems)[:300]
    return True, detail + f"0 new graphs, no recompilation, every result compiled ({args.compile})"


def run_compiled_checks(
    report: Report, label: str, model: MTPCModel, args: argparse.Namespace
) -> None:
    """The compiled engine's lines of one target (SKIP, with the reason, where refused)."""
    checks: tuple[Callable[[], tuple[bool | None, str]], ...] = (
        lambda: compare_compiled(model, args, "autoregressive", True),
        lambda: compare_compiled(model, args, "speculative", True),
        lambda: check_compiled_sampled(model, args),
        lambda: check_no_recompile(model, args),
    )  # COMPILED_LINES, in order
    refusal = compile_refusal(model, args)
    for name, check in zip(COMPILED_LINES, checks, strict=True):
        if refusal is not None:
            report.add("SKIP", f"{name}[{label}]", refusal)
        else:
            report.run(f"{name}[{label}]", check)


@contextmanager
def _quiet() -> Iterator[None]:
    import logging
    import warnings

    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(level)


def _compose(overrides: Sequence[str], root: Path) -> Any:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.root_dir = str(root)
        cfg.paths.cache_dir = str(root / "cache")
        cfg.paths.output_dir = str(root / "single")
        cfg.run_dir = str(root / "single")
    return cfg


def check_train_single(args: argparse.Namespace, root: Path) -> tuple[bool | None, str]:
    """Three optimizer steps in this process (trainer=gpu or cpu)."""
    import lightning as L
    from hydra.utils import instantiate

    from mtpc.training.module import MTPCLightningModule
    from mtpc.training.run import build_model, build_trainer
    from mtpc.training.settings import TrainSettings

    trainer_name = "gpu" if args.device.startswith("cuda") else "cpu"
    extra = [f"model.dtype={args.dtype}"]  # the script's dtype, whatever the model= default
    cfg = _compose([f"trainer={trainer_name}", *TRAIN_OVERRIDES, *extra, *args.overrides], root)
    settings = TrainSettings.from_cfg(cfg)  # the config read once, as train(cfg) does
    L.seed_everything(0)
    model = build_model(**settings.model_arguments())
    module = MTPCLightningModule(
        model, loss=cfg.loss.name, chunk_size=int(cfg.loss.chunk_size),
        optimizer=instantiate(cfg.optimizer),
    )  # fmt: skip
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    start = {n: p.detach().float().clone() for n, p in trainable.items()}
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trainable.values()})
    trunk = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for n, p in module.named_parameters()
            if n not in trainable
        }
    )

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            _sync(args.device)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl: Any, outputs: Any, *_: Any) -> None:
            _sync(args.device)
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(outputs["loss"]))

    steps = Steps()
    from lightning.pytorch.callbacks import ModelCheckpoint

    last = ModelCheckpoint(root / "single" / "checkpoints", save_top_k=0, save_last=True,
                           every_n_train_steps=3)  # fmt: skip
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(settings, root / "single", [steps, last])
    trainer.fit(module, datamodule=instantiate(cfg.data))
    moved = {n: float((p.detach().float() - start[n]).abs().max()) for n, p in trainable.items()}
    still = sorted(n for n, v in moved.items() if v == 0.0)
    ckpts = sorted((root / "single").rglob("*.ckpt"))
    saved = torch.load(ckpts[-1], weights_only=False)["state_dict"] if ckpts else {}
    only_trained = bool(saved) and sorted(saved) == sorted(trainable)
    attention = attention_path(model)
    ok = (
        dtypes == ["float32"]
        and len(steps.losses) == 3
        and all(torch.isfinite(torch.tensor(steps.losses)))
        and not still
        and only_trained
    )
    times = ", ".join(f"{t * 1000:.0f}" for t in steps.times)
    size = f"{ckpts[-1].stat().st_size / 2**20:.1f} MiB" if ckpts else "none written"
    return ok, (
        f"attention {attention}; precision {cfg.trainer.precision}; "
        f"trainable {len(trainable)} tensors {dtypes} (trunk {trunk}); "
        f"loss {', '.join(f'{v:.3f}' for v in steps.losses)}; "
        f"{'every trainable tensor moved' if not still else f'did not move: {still[:3]}'}; "
        f"peak {_peak_memory(args.device)}; step ms {times}; checkpoint {size}, "
        f"{'trained weights only' if only_trained else f'{len(saved)} tensors, not the trained set'}"
    )


def check_train_two_process(
    strategy: str, args: argparse.Namespace, root: Path
) -> tuple[bool | None, str]:
    """``train.py trainer=<ddp|fsdp>`` (``*_cpu`` on CPU) on two processes, three steps."""
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if not args.two_process and gpus < 2:
        return None, f"{gpus} GPU(s) visible; two-process training needs 2 (or --two-process)"
    trainer = strategy if args.device.startswith("cuda") else f"{strategy}_cpu"
    folder = root / strategy
    env = {**os.environ, "PROJECT_ROOT": str(root), "MTPC_CACHE": str(root / "cache")}
    devices = ["trainer.devices=2"] if args.device.startswith("cuda") else []
    extra = [f"model.dtype={args.dtype}"]  # the script's dtype, whatever the model= default
    command = [sys.executable, str(REPO / "train.py"), f"trainer={trainer}", *devices,
               f"hydra.run.dir={folder}", *TRAIN_OVERRIDES, *extra, *args.overrides]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        return False, f"train.py exited {result.returncode}: {result.stderr.strip()[-300:]}"
    metrics = json.loads((folder / "metrics.json").read_text())
    state = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    finite = all(torch.isfinite(v).all() for v in state.values())
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
    only_trained = all(".head." in k or "lora_" in k for k in state)
    ok = metrics.get("train/steps") == 3 and finite and only_trained and dtypes == ["float32"]
    ok = ok and (folder / "draft" / "head.safetensors").is_file()
    return ok, (
        f"trainer={trainer}, {metrics.get('train/steps')} steps in {seconds:.0f} s (with start-up); "
        f"last.ckpt: {len(state)} tensors {dtypes}, "
        f"{'trained weights only' if only_trained else 'frozen weights too'}, finite {finite}; "
        "draft exported"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with ``dtype`` defaulted for the device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--dtype", default=None, help="target dtype (default bf16 on cuda, fp32 on cpu)"
    )
    parser.add_argument("--evabyte-code", type=Path, default=os.environ.get("MTPC_EVABYTE_CODE") or None,
                        help="directory with EvaByte's remote code (evabyte_hf/*.py)")  # fmt: skip
    parser.add_argument("--two-process", action="store_true", help="ddp and fsdp on 2 processes")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="logit tolerance (fp32)")
    parser.add_argument("--bf16-rtol", type=float, default=0.02, help="logit tolerance (bf16)")
    parser.add_argument("--min-ar-speed", type=float, default=0.5,
                        help="our AR tokens/s over generate()'s, at least")  # fmt: skip
    parser.add_argument("--break-kernel", action="store_true",
                        help="self-test: force a wrong forward BLOCK_M into EvaByte's kernels "
                             "after each load (its checks FAIL)")  # fmt: skip
    parser.add_argument("--compile", choices=COMPILE_BACKENDS, default=None,
                        help="the compiled engine's lines: torch.compile backend (default "
                             "inductor on cuda, none on cpu: SKIP)")  # fmt: skip
    parser.add_argument(TF32_CHILD, dest="tf32_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="training overrides (after --)")
    args = parser.parse_args(argv)
    if args.evabyte_code is not None:
        args.evabyte_code = Path(args.evabyte_code)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.compile = args.compile or ("inductor" if cuda else "none")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if interpreter_mode(args):  # before triton (and the remote kernels) are imported
        os.environ["TRITON_INTERPRET"] = "1"
    if args.tf32_child:  # check_eva_tf32's measurement, TRITON_F32_DEFAULT as the parent set it
        with _quiet():
            print(json.dumps(eva_logits(args, args.tf32_child)), flush=True)
        return 0
    if args.dtype == "float32":  # the exactness checks: tl.dot in IEEE float32, not TF32
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's own float32 matmuls too
        torch.backends.cudnn.allow_tf32 = False
    report = Report()
    report.run("device", lambda: check_device(args))
    if report.failed:
        return 1
    with tempfile.TemporaryDirectory(prefix="mtpc-check-") as tmp, _quiet():
        root = Path(tmp)
        run_checks(report, args, root)
    return 1 if report.failed else 0


def run_checks(report: Report, args: argparse.Namespace, root: Path) -> None:
    """Every check after ``device``, each inside ``report.run`` (a crash is one FAIL line)."""
    models: dict[str, MTPCModel] = {}
    eva: dict[str, str] = {}

    def load(label: str, name: str) -> tuple[bool | None, str]:
        path = None
        if name == "evabyte":
            eva["path"] = path = str(tiny_evabyte_checkpoint(args.evabyte_code, root))
        models[label] = model = draft_model(name, path, args)
        return True, f"{name}, {args.dtype}, attention {attention_path(model)}"

    eva_skip = _eva_skip(args)
    if eva_skip is None and not args.device.startswith("cuda") and args.dtype != "float32":
        eva_skip = (
            "triton's interpreter computes bf16 wrongly (triton issue #11584): --dtype float32"
        )
    report.run("load[tiny]", lambda: load("tiny", "tiny"))
    if args.evabyte_code:
        report.run("load[evabyte-tiny]", lambda: load("evabyte-tiny", "evabyte"))
    else:
        report.add("SKIP", "load[evabyte-tiny]", "no EvaByte remote code (--evabyte-code DIR)")
    for name, check in (("eva_triton_vs_torch", check_eva_triton),
                        ("eva_tf32_error", check_eva_tf32),
                        ("eva_train_triton_vs_torch", check_eva_train)):  # fmt: skip
        if eva_skip is not None:
            report.add("SKIP", name, eva_skip)
        elif "path" not in eva:
            report.add("FAIL", name, "the tiny EvaByte did not load (load[evabyte-tiny])")
        else:
            report.run(name, lambda c=check: c(args, eva["path"]))
    for label, model in models.items():
        report.run(f"one_pass_verify[{label}]", lambda m=model: check_one_pass(m, args))
        report.run(f"greedy_spec_equals_ar[{label}]", lambda m=model: check_greedy(m, args))
        if label == "tiny":  # EvaByte's remote code predates transformers 5's generate()
            report.run(f"ar_vs_hf_generate[{label}]", lambda m=model: check_ar_speed(m, args))
    report.run("train[single]", lambda: check_train_single(args, root))
    for strategy in STRATEGIES[1:]:
        report.run(f"train[{strategy}]", lambda s=strategy: check_train_two_process(s, args, root))
    for label, model in models.items():  # last: compiling is the slowest part on a cold cache
        run_compiled_checks(report, label, model, args)


if __name__ == "__main__":
    sys.exit(main())
