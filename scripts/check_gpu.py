"""GPU self-check: what only a GPU can show, in about two minutes, before a long job.

    python scripts/check_gpu.py                        # one GPU (two-GPU part when 2 are visible)
    python scripts/check_gpu.py --evabyte-code DIR     # + EvaByte's triton vs torch attention
    python scripts/check_gpu.py --device cpu           # the same checks on CPU (the test suite)
    python scripts/check_gpu.py -- model.dtype=bfloat16 lora.layers=2   # training overrides

One line per check, ``PASS name: detail``, ``FAIL name: detail`` or ``SKIP name: why``;
the exit status is 1 when any check fails. Checks (docs/TRAINING.md, "GPU self-check"):

* ``device``: the device, torch / CUDA versions, bf16 support, visible GPUs.
* ``eva_triton_vs_torch``: EvaByte's real remote code (``--evabyte-code``, a directory with
  ``evabyte_hf/*.py``) as a tiny random checkpoint (EVA window 16, chunk 4), loaded once
  with ``model.attention_impl=triton`` and once with ``torch``: the logits of a 40-byte
  prompt (past one window, so the window compression ``triton_eva_prep_kv_fwd`` runs) agree.
* ``one_pass_verify[<target>]``: a drafted window run in one cached trunk pass gives the
  logits of the same positions fed one per pass (how every cycle verifies).
* ``greedy_spec_equals_ar[<target>]``: greedy self-speculative output through
  ``mtpc.generate`` equals autoregressive output token for token.
* ``ar_vs_hf_generate[<target>]``: our autoregressive decoding gives the target's own
  ``generate`` output, and its tokens per second against ``generate``'s
  (fails below ``--min-ar-speed``).
* ``train[<strategy>]``: three optimizer steps of the draft (LoRA on the last layer): the
  attention path, trainable dtypes (all float32), a finite loss, every trainable tensor
  moved, peak memory, step times, the checkpoint's size and that it holds only trained
  weights. ``single`` runs in this process; ``ddp`` and ``fsdp`` run ``train.py`` on two
  processes when two GPUs are visible (``--two-process`` forces it, on CPU with gloo).

Targets: the bundled tiny target, and the tiny EvaByte of the real code with
``--evabyte-code``. Nothing is downloaded.
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
from typing import Any

import torch

import mtpc
from mtpc.backbones import load_backbone
from mtpc.benchmarking import peak_memory_mb
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


def tiny_evabyte_checkpoint(code: Path, root: Path) -> Path:
    """A tiny random checkpoint of EvaByte's real code (window 16, chunk 4, 2 layers)."""
    tools = _remote_code_tools()
    source = code / "evabyte_hf" if (code / "evabyte_hf").is_dir() else code
    folder, _ = tools.write_checkpoint(
        "evabyte", source, "default", root, window_size=16, chunk_size=4, num_hidden_layers=2
    )
    return Path(folder)


def targets(args: argparse.Namespace, root: Path) -> Iterator[tuple[str, str, str | None]]:
    """``(label, model name, path)`` of each target the decoding checks run on."""
    yield "tiny", "tiny", None
    if args.evabyte_code:
        yield "evabyte-tiny", "evabyte", str(tiny_evabyte_checkpoint(args.evabyte_code, root))


def draft_model(name: str, path: str | None, args: argparse.Namespace, **kwargs: Any) -> MTPCModel:
    backbone = load_backbone(name, path=path, dtype=args.dtype, device=args.device, **kwargs)
    return MTPCModel.from_backbone(backbone, "btree", 4, 2, lora_layers=1)


def _prompt(model: MTPCModel, length: int, seed: int = 0) -> list[int]:
    from mtpc.backbones.codecs import get_codec

    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs. "
    if model.backbone.codec is not None:
        return get_codec(model.backbone.codec).encode(text * 4)[:length]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.backbone.vocab_size, (length,), generator=g).tolist()


def _close(a: torch.Tensor, b: torch.Tensor, args: argparse.Namespace) -> tuple[bool, str]:
    """Logits that agree: within ``--tolerance`` in float32; in bf16 within ``--bf16-rtol``
    of the logits' scale (bf16 keeps 8 bits: a logit of 16 is rounded to steps of 0.06)."""
    diff = float((a - b).abs().max())
    if args.dtype == "float32":
        return diff <= args.tolerance, f"max |diff| {diff:.2e} (tolerance {args.tolerance:.0e})"
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))
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
            f"{torch.cuda.is_bf16_supported()}"
        )
    return True, f"cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def check_eva_triton(args: argparse.Namespace, root: Path) -> tuple[bool | None, str]:
    if not args.device.startswith("cuda"):
        return None, "the triton kernels need a CUDA GPU (the CPU runs EVA's pure-torch path)"
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    if not args.evabyte_code:
        return None, "no EvaByte remote code (--evabyte-code DIR with evabyte_hf/*.py)"
    path = str(tiny_evabyte_checkpoint(args.evabyte_code, root))
    ids = torch.tensor([_prompt(draft_model("evabyte", path, args), 40)], device=args.device)
    logits = {}
    for impl in ("triton", "torch"):
        backbone = load_backbone(
            "evabyte", path=path, dtype=args.dtype, device=args.device, attention_impl=impl
        )
        with torch.no_grad():
            hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)
            logits[impl] = backbone.stp_logits(backbone.norm(hidden))[0].float()  # (40, V)
    ok, detail = _close(logits["triton"], logits["torch"], args)
    same = float((logits["triton"].argmax(-1) == logits["torch"].argmax(-1)).float().mean())
    return (
        ok,
        f"40 bytes (EVA window 16, chunk 4), triton vs torch logits: {detail}; same argmax {same:.0%}",
    )


def check_one_pass(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    backbone = model.backbone
    ids = torch.tensor([_prompt(model, 40, seed=2)], device=args.device)  # (1, 40)
    layers = backbone.num_layers
    cache = backbone.new_cache(0, layers)

    def logits(chunk: torch.Tensor, into: Any) -> torch.Tensor:
        hidden = backbone.run_layers(backbone.embed(chunk), 0, layers, cache=into)
        return backbone.stp_logits(backbone.norm(hidden))[0].float()  # (len, V)

    with torch.no_grad():
        logits(ids[:, :21], cache)
        span = backbone.one_pass_span(21, 16)  # to EvaByte's window boundary; 16 elsewhere
        sequential = cache.clone()
        one = logits(ids[:, 21 : 21 + span], cache)
        seq = torch.cat([logits(ids[:, i : i + 1], sequential) for i in range(21, 21 + span)])
    ok, detail = _close(one, seq, args)
    return ok, f"{span} positions in one pass vs one per pass: {detail}"


def check_greedy(model: MTPCModel, args: argparse.Namespace) -> tuple[bool | None, str]:
    prompt = _prompt(model, 24)
    kw = {"max_new_tokens": args.new_tokens, "greedy": True, "suppress_eos": True}
    ar = mtpc.generate(model, prompt, method="autoregressive", **kw)
    sd = mtpc.generate(model, prompt, method="speculative", **kw)
    cycles = max(len(sd.accepted), 1)
    same = list(sd.tokens) == list(ar.tokens)
    first = next(
        (i for i, (a, b) in enumerate(zip(sd.tokens, ar.tokens, strict=False)) if a != b), None
    )
    where = "" if same else f", first difference at token {first}"
    return same, (
        f"{len(ar.tokens)} tokens, speculative == autoregressive {same}{where}; "
        f"{sum(sd.accepted) / cycles:.2f} accepted drafts per cycle (untrained head)"
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

    trainer_name = "gpu" if args.device.startswith("cuda") else "cpu"
    extra = [f"model.dtype={args.dtype}"] if args.dtype != "float32" else []
    cfg = _compose([f"trainer={trainer_name}", *TRAIN_OVERRIDES, *extra, *args.overrides], root)
    L.seed_everything(0)
    model = build_model(cfg)
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
    trainer = build_trainer(cfg, root / "single", [steps, last])
    trainer.fit(module, datamodule=instantiate(cfg.data))
    moved = {n: float((p.detach().float() - start[n]).abs().max()) for n, p in trainable.items()}
    still = sorted(n for n, v in moved.items() if v == 0.0)
    ckpts = sorted((root / "single").rglob("*.ckpt"))
    saved = torch.load(ckpts[-1], weights_only=False)["state_dict"] if ckpts else {}
    only_trained = bool(saved) and sorted(saved) == sorted(trainable)
    attention = getattr(model.backbone, "attention_path", None) or getattr(
        model.backbone.hf_model.config, "_attn_implementation", "?"
    )
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
        f"attention {attention}; trainable {len(trainable)} tensors {dtypes} (trunk {trunk}); "
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
    extra = [f"model.dtype={args.dtype}"] if args.dtype != "float32" else []
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


def main(argv: Sequence[str] | None = None) -> int:
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
    parser.add_argument("overrides", nargs="*", help="training overrides (after --)")
    args = parser.parse_args(argv)
    if args.evabyte_code is not None:
        args.evabyte_code = Path(args.evabyte_code)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    report = Report()
    report.run("device", lambda: check_device(args))
    if report.failed:
        return 1
    with tempfile.TemporaryDirectory(prefix="mtpc-check-") as tmp, _quiet():
        root = Path(tmp)
        report.run("eva_triton_vs_torch", lambda: check_eva_triton(args, root))
        if not args.evabyte_code:
            report.add("SKIP", "evabyte-tiny", "no EvaByte remote code (--evabyte-code DIR)")
        for label, name, path in targets(args, root):
            model = draft_model(name, path, args)
            report.run(f"one_pass_verify[{label}]", lambda m=model: check_one_pass(m, args))
            report.run(f"greedy_spec_equals_ar[{label}]", lambda m=model: check_greedy(m, args))
            if name == "tiny":  # EvaByte's remote code predates transformers 5's generate()
                report.run(f"ar_vs_hf_generate[{label}]", lambda m=model: check_ar_speed(m, args))
        report.run("train[single]", lambda: check_train_single(args, root))
        for strategy in STRATEGIES[1:]:
            report.run(
                f"train[{strategy}]", lambda s=strategy: check_train_two_process(s, args, root)
            )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
