"""The GPU readings in one command: decoding and training at the paper's shapes, random weights.

Reproduces and extends the first H200 readings (docs/BENCHMARKS.md, "GPU readings": the
command, the columns, the readings; ``scripts/device_run.sh`` runs it on a bare GPU machine).
Two targets, each a random checkpoint written to a temporary folder and loaded through
``mtpc.backbones.load_backbone`` (the project's loader, its load-time check included):

* ``evabyte``: EvaByte's real remote code (``--evabyte-code DIR`` or ``$MTPC_EVABYTE_CODE``, a
  folder holding ``evabyte_hf/*.py``) at the paper's shape: 32 layers, d 4096, intermediate
  11008, 32 heads, EVA window 2048, chunk 16 (on a GPU the triton kernels, on a CPU the
  pure-torch path);
* ``byte_llama``: a ``LlamaForCausalLM`` at Llama-3.2-3B's shape (28 layers, d 3072, 24 heads,
  8 KV heads, intermediate 8192, sdpa attention) with the byte Llama's vocabulary (272), as
  ``model=llama3_byte`` loads it; no input expansion (random weights have no table).

Parts (``--parts``), each under its own guard (a failing part is one line of the report):

* ``decode``: the copy bandwidth and weight bytes -> the memory-bound AR step; the AR step at
  sequence lengths seen before (wall and GPU-busy time: torch.profiler's CUDA time, n/a on a
  CPU); the first-visit penalty (a step at lengths never seen, over a warm step);
* ``cycle``: the all-accepting n-draft cycle (``max_throughput=True``) of FF, CP r and BTree
  r: wall, GPU busy, tokens per cycle, cost in AR steps;
* with ``--compile BACKEND`` (default: ``inductor`` on CUDA, ``none`` (skipped) on a CPU)
  the decode and cycle readings are taken again on the static, compiled engine
  (``compile=BACKEND``, docs/DECODING.md "Compiled decoding"; EvaByte's
  ``mtpc.decoding.static_eva``): the AR step, its first visit of new lengths, the cycles (a
  target the engine refuses: the refusal, one line);
* ``batch``: on the tiny target (``assets/tiny_target``), batched speculative vs
  autoregressive tokens/s at each B (``scripts/bench_batch.py``'s measurement; outputs
  exact);
* ``train``: one optimizer step of BTree n r with LoRA on the last layer, rows of
  ``--train-lengths`` bytes, batch 1, as the trainer runs it
  (``MTPCLightningModule._objective``, ``configure_optimizers``) under ``--precisions``:
  ``32-true`` (no autocast: what the first H200 reading ran) and ``bf16-mixed``
  (``trainer=gpu``: ``torch.autocast`` around the forward, float32 trainable weights):
  seconds per step, bytes/s, peak memory and MFU.

MFU counts weight matmuls only (attention's are left out: a lower bound) over T positions:
the frozen trunk's forward 2·P·T, the LoRA tail's forward and input backward 4·P_tail·T
(+ 6·P_LoRA·T), the head's weights (the n·r·V·d unembeddings and the sum projections)
forward, recompute and backward 8·P_head·T; over ``--peak-tflops`` (default: by the device
name, :data:`PEAK_TFLOPS`; unknown: n/a).

    python scripts/bench_gpu.py --out gpu.json                       # a GPU, both targets
    python scripts/bench_gpu.py --parts decode,cycle --targets byte_llama
    python scripts/bench_gpu.py --device cpu --dtype float32 --layers 2 --hidden 64 \\
        --intermediate 128 --heads 4 --kv-heads 2 --window 32 --chunk 4 ...   # the smoke test

Prints one JSON line per finished part, then the Markdown tables; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bench_batch
import torch
from benchlib import machine, markdown_header, markdown_row, median_time, write_json
from check_remote_code import EVABYTE_CONFIG, LLAMA3_BYTE_CONFIG, remote_class

from mtpc.evaluation.run import peak_memory_mb, sync_memory_reset

PARTS = ("decode", "cycle", "batch", "train")
TARGETS = ("evabyte", "byte_llama")
PRECISIONS = ("32-true", "bf16-mixed")
KIND_NAMES = {"ff": "FF", "cp": "CP", "hmm": "HMM", "btree": "BTree"}
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
               ("A100", 312.0), ("L40S", 362.0))  # fmt: skip
"""Dense bf16 tensor-core peak (TFLOP/s) by a substring of the device name, first match."""

EVABYTE_SHAPE = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_attention_heads": 32, "window_size": 2048, "chunk_size": 16}  # fmt: skip
"""EvaByte-SFT (6.5 B)."""
LLAMA_SHAPE = {"num_hidden_layers": 28, "hidden_size": 3072, "intermediate_size": 8192,
               "num_attention_heads": 24, "num_key_value_heads": 8}  # fmt: skip
"""Llama-3.2-3B (the byte Llama's trunk)."""
SIZE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
              "intermediate": "intermediate_size", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "window": "window_size",
              "chunk": "chunk_size"}  # fmt: skip
"""Size overrides: flag -> config key (a key a target's shape lacks is not applied to it)."""

BYTE_LLAMA_CODE = {
    "configuration_byte_llama.py": (
        "from transformers import LlamaConfig\n\n\n"
        "class ByteLlamaConfig(LlamaConfig):\n"
        '    model_type = "tpu_llama"\n'
    ),
    "modeling_byte_llama.py": (
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_byte_llama import ByteLlamaConfig\n\n\n"
        "class ByteLlamaForCausalLM(LlamaForCausalLM):\n"
        "    config_class = ByteLlamaConfig\n"
    ),
}
"""The random byte Llama's remote code: transformers' Llama under tokenkit's model_type."""


# -- random checkpoints -------------------------------------------------------------------------
def write_random_checkpoint(
    folder: Path, files: dict[str, bytes], config: dict[str, Any], kind: str, device: str
) -> Path:
    """A hub-style checkpoint (``config.json``, remote ``files``, ``model.safetensors``) of
    random weights (matrices N(0, 1/fan_in), norms 1, other vectors N(0, 0.1^2)): the model is
    built on the meta device, each tensor drawn on ``device`` (fast on a GPU) in float32."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_bytes(text)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    hf_config, cls = remote_class(folder, kind)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in cls(hf_config).state_dict().items()}
    dtype = getattr(torch, config["torch_dtype"])
    generator = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if len(shape) >= 2:
            weight = torch.randn(shape, generator=generator, device=device) / shape[-1] ** 0.5
        elif "norm" in name:
            weight = torch.ones(shape)
        else:
            weight = 0.1 * torch.randn(shape, generator=generator, device=device)
        state[name] = weight.to(dtype).cpu()
    save_file(state, folder / "model.safetensors")
    return folder


def sizes(shape: dict[str, int], args: argparse.Namespace) -> dict[str, int]:
    """A target's shape with the size flags given (those of keys it has)."""
    given = {SIZE_FLAGS[f]: v for f in SIZE_FLAGS if (v := getattr(args, f)) is not None}
    return {**shape, **{k: v for k, v in given.items() if k in shape}}


def load_target(name: str, args: argparse.Namespace) -> Any:
    """The backbone of target ``name`` (random weights, ``args`` sizes, dtype and device),
    from a checkpoint in a temporary folder (removed once loaded)."""
    with tempfile.TemporaryDirectory(prefix="mtpc-bench-gpu-") as tmp:
        return _load_target(name, args, Path(tmp))


def _load_target(name: str, args: argparse.Namespace, root: Path) -> Any:
    from mtpc.backbones import load_backbone

    context = max(args.prompt_len + args.steps * (args.n + 1), *args.train_lengths) + 64
    common = {"max_position_embeddings": context, "torch_dtype": args.dtype}
    if name == "evabyte":
        code = args.evabyte_code / "evabyte_hf"
        code = code if code.is_dir() else args.evabyte_code
        files = {p.name: p.read_bytes() for p in code.glob("*.py")
                 if p.name != "__init__.py" and "flax" not in p.name}  # fmt: skip
        config = {**EVABYTE_CONFIG, **sizes(EVABYTE_SHAPE, args), **common}
        folder = write_random_checkpoint(root / "evabyte", files, config, "evabyte", args.device)
        return load_backbone("evabyte", path=str(folder), dtype=args.dtype, device=args.device,
                             attention_impl=args.attention_impl)  # fmt: skip
    config = {
        **{k: v for k, v in LLAMA3_BYTE_CONFIG.items() if not k.startswith("expand_")},
        **sizes(LLAMA_SHAPE, args), **common,
        "architectures": ["ByteLlamaForCausalLM"], "attn_implementation": "sdpa",
        "auto_map": {"AutoConfig": "configuration_byte_llama.ByteLlamaConfig",
                     "AutoModelForCausalLM": "modeling_byte_llama.ByteLlamaForCausalLM"},
    }  # fmt: skip
    files = {k: v.encode() for k, v in BYTE_LLAMA_CODE.items()}
    folder = write_random_checkpoint(root / "byte_llama", files, config, "llama3_byte", args.device)
    return load_backbone("llama3_byte", path=str(folder), dtype=args.dtype, device=args.device)


# -- measuring ----------------------------------------------------------------------------------
def cuda(device: str) -> bool:
    return device.startswith("cuda")


def copy_bandwidth(device: str, mib: int) -> float:
    """GB/s of a device-to-device copy of ``mib`` MiB, counting bytes read and written."""
    x = torch.empty(mib << 19, dtype=torch.bfloat16, device=device)  # (mib MiB,)
    y = torch.empty_like(x)
    seconds, _ = median_time(lambda: y.copy_(x), repeats=10, device=device, warmup=3)
    return 2 * (mib << 20) / seconds / 1e9


def profiled_ms(fn: Callable[[], Any], device: str) -> tuple[float | None, float, Any]:
    """(CUDA ms, CPU ms) that torch.profiler records during ``fn()`` (CUDA: None on a CPU),
    and its result."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda(device) else [])
    with profile(activities=activities) as prof:
        out = fn()
        if cuda(device):
            torch.cuda.synchronize()
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3
    if not cuda(device):
        return None, cpu, out
    gpu = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    return gpu / 1e3, cpu, out


def step_readings(model: Any, prompt: list[int], new: int, device: str, **kw: Any) -> dict:
    """Wall ms of a step (the median over the steps of a run of ``new`` tokens, at lengths a
    run visited before), and its GPU-busy and CPU ms (profiled runs of ``new`` and of 1 new
    token: the difference over the difference in steps, so the prefill cancels)."""
    from mtpc.decoding import generate

    def run(count: int) -> Any:
        return generate(model, prompt, count, stop_ids=(), **kw)

    run(new)  # warms these lengths (kernels, plans, allocator)
    out = run(new)
    gpu_all, cpu_all, _ = profiled_ms(lambda: run(new), device)
    gpu_one, cpu_one, one = profiled_ms(lambda: run(1), device)
    steps = max(1, len(out.cycle_seconds) - len(one.cycle_seconds))
    wall = 1e3 * statistics.median(out.cycle_seconds)
    gpu = None if gpu_all is None or gpu_one is None else (gpu_all - gpu_one) / steps
    return {
        "wall_ms": wall,
        "gpu_ms": gpu,
        "gpu_busy_share": None if gpu is None else gpu / wall,
        "cpu_ms": (cpu_all - cpu_one) / steps,
        "tokens_per_step": sum(out.emitted) / max(1, len(out.emitted)),
        "steps": len(out.cycle_seconds),
    }


def random_prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 256), (length,), generator=g).tolist()


def compile_refusal(model: Any, args: argparse.Namespace) -> str | None:
    """Why the compiled readings are not taken (``--compile none``, the engine's refusal)."""
    if args.compile == "none":
        return "--compile none"
    from mtpc.decoding.static import supports_compile

    return supports_compile(model, args.compile)


def measure_decode(backbone: Any, args: argparse.Namespace, copy_gbps: float) -> dict[str, Any]:
    """The memory-bound step, the warm AR step and the first-visit penalty (eager, then
    ``compiled_``: on the compiled engine)."""
    from mtpc.decoding import generate
    from mtpc.model import MTPCModel

    model = MTPCModel.from_backbone(backbone, "ff", args.n, 1, head_dtype=args.dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in backbone.hf_model.parameters())
    prompt = random_prompt(args.prompt_len, backbone.vocab_size)
    found = {
        "weight_GB": weight_bytes / 1e9,
        "memory_bound_step_ms": 1e3 * weight_bytes / (copy_gbps / 2 * 1e9),
    }
    refusal = compile_refusal(model, args)
    for prefix, compile in (("", False), ("compiled_", args.compile)):
        if compile and refusal is not None:
            found["compiled_skipped"] = refusal
            continue
        kw = {"method": "autoregressive", "compile": compile}
        with torch.no_grad():
            warm = step_readings(model, prompt, args.steps, args.device, **kw)
            cold_prompt = prompt[: args.prompt_len // 2 + 1]  # lengths no run has visited
            cold = generate(model, cold_prompt, args.steps, stop_ids=(), **kw)
        cold_ms = 1e3 * statistics.median(cold.cycle_seconds)
        found.update({
            f"{prefix}ar_wall_ms": warm["wall_ms"],
            f"{prefix}ar_gpu_ms": warm["gpu_ms"],
            f"{prefix}ar_gpu_busy_share": warm["gpu_busy_share"],
            f"{prefix}ar_cpu_ms": warm["cpu_ms"],
            f"{prefix}ar_cold_wall_ms": cold_ms,
            f"{prefix}first_visit_penalty": cold_ms / warm["wall_ms"],
            f"{prefix}engine": cold.engine,
        })  # fmt: skip
    return found


def measure_cycle(backbone: Any, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The all-accepting cycle of one head kind (rank 1 for FF)."""
    from mtpc.model import MTPCModel

    rank = 1 if kind == "ff" else args.rank
    model = MTPCModel.from_backbone(backbone, kind, args.n, rank, head_dtype=args.dtype).eval()
    prompt = random_prompt(args.prompt_len, backbone.vocab_size)
    new = args.steps * args.n  # all-accepting: n tokens per cycle
    with torch.no_grad():
        found = step_readings(model, prompt, new, args.device, max_throughput=True)
        refusal = compile_refusal(model, args)
        if refusal is None:  # the same cycles on the compiled engine
            found["compiled"] = step_readings(
                model, prompt, new, args.device, max_throughput=True, compile=args.compile
            )
    return {"rank": rank, **found}


def peak_tflops(args: argparse.Namespace, name: str) -> float | None:
    """``--peak-tflops``, else the device's dense bf16 peak by its name (None: unknown)."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def training_flops(model: Any, tokens: int) -> float:
    """Matmul FLOPs of one step (see the module docstring): trunk, LoRA tail, head."""
    backbone, k = model.backbone, model.k

    def frozen(layers: Sequence[Any]) -> int:
        return sum(p.numel() for m in layers for n, p in m.named_parameters() if "lora_" not in n)

    lora = sum(p.numel() for p in model.trainable_parameters()) - sum(
        p.numel() for p in model.head.parameters() if p.requires_grad
    )
    trunk = frozen(backbone.layers[: backbone.num_layers - k])
    tail = frozen(backbone.layers[backbone.num_layers - k :])
    head = sum(p.numel() for p in model.head.parameters())
    return tokens * (2 * trunk + 4 * tail + 6 * lora + 8 * head)


def row_batch(length: int, window: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """One row of ``length`` random bytes, one document, as the datamodule's batch (B = 1)."""
    from mtpc.data.windows import make_windows

    ids = torch.tensor([random_prompt(length, vocab, seed=length)])  # (1, L)
    documents = torch.zeros_like(ids)  # (1, L)
    targets, target_mask, window_mask = make_windows(
        ids, documents, torch.ones_like(ids, dtype=torch.bool), window, pad_id=0
    )  # (1, L, n) each
    batch = {"input_ids": ids, "targets": targets, "target_mask": target_mask,
             "window_mask": window_mask, "document_ids": documents,
             "position_ids": torch.arange(length)[None],  # (1, L)
             "index": torch.zeros(1, dtype=torch.long)}  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def measure_train(backbone: Any, args: argparse.Namespace, peak: float | None) -> list[dict]:
    """Seconds per optimizer step, bytes/s, peak memory and MFU per (precision, row length)."""
    from mtpc.model import MTPCModel
    from mtpc.training.module import MTPCLightningModule

    model = MTPCModel.from_backbone(backbone, "btree", args.n, args.rank, lora_layers=1)
    module = MTPCLightningModule(model, chunk_size=args.loss_chunk).to(args.device)
    module.train()
    optimizer = module.configure_optimizers()
    device_type = torch.device(args.device).type
    rows = []
    for precision in args.precisions:
        for length in args.train_lengths:
            batch = row_batch(length, args.n, backbone.vocab_size, args.device)

            def step(precision: str = precision, batch: dict = batch) -> float:
                with (
                    torch.autocast(device_type, dtype=torch.bfloat16)
                    if precision == "bf16-mixed"
                    else contextlib.nullcontext()
                ):
                    loss = module._objective(batch)[0].loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.item()

            sync_memory_reset(args.device)
            seconds, loss = median_time(step, args.train_steps, args.device, warmup=1)
            flops = training_flops(model, length)
            rows.append({
                "precision": precision, "bytes": length, "step_s": seconds,
                "bytes_per_s": length / seconds, "loss": loss,
                "peak_GB": peak_memory_mb(args.device) * 2**20 / 1e9 if cuda(args.device) else None,
                "tflop_per_step": flops / 1e12,
                "mfu": None if peak is None else flops / seconds / (peak * 1e12),
            })  # fmt: skip
    return rows


def measure_batch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``scripts/bench_batch.py``'s greedy rows on the tiny target at ``--batch-sizes``."""
    options = bench_batch.parse([
        "--device", args.device, "--prompts", str(args.batch_prompts),
        "--max-new-tokens", str(args.batch_new), "--sizes", *map(str, args.batch_sizes),
    ])  # fmt: skip
    _, model = bench_batch._model(options)
    context = int(getattr(model.backbone.config, "max_position_embeddings", 1024))
    prompts = bench_batch._prompts(
        options.prompts, model.backbone.codec, context - options.max_new_tokens - options.window - 1
    )
    return bench_batch.measure_decoding(model, prompts, options)


# -- the report ---------------------------------------------------------------------------------
class Report:
    """The JSON report; :meth:`run` guards and times a part (its exception becomes one error
    line; its seconds go under ``seconds``, loads included)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.data: dict[str, Any] = {
            "machine": machine(), "device": device_name(args.device), "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()}, "errors": {}, "seconds": {},
        }  # fmt: skip
        self.out = args.out

    def run(self, name: str, fn: Callable[[], Any], into: dict[str, Any] | None = None) -> Any:
        """``fn()``, stored under ``name``'s last part in ``into`` (default: the report) and
        printed as a JSON line, except for a ``.../load`` (only returned); None after an
        exception (a ``FAILED name: error`` line, kept under the report's ``errors``)."""
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as err:  # one failing part is a line of the report, not a crash
            traceback.print_exc(file=sys.stderr)
            self.data["errors"][name] = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
            print(f"FAILED {name}: {self.data['errors'][name]}", flush=True)
            return None
        finally:
            self.data["seconds"][name] = time.perf_counter() - start
        if name.endswith("load"):
            return value
        (self.data if into is None else into)[name.rpartition("/")[2]] = value
        print(json.dumps({name: value}, default=str), flush=True)
        write_json(self.out, self.data, default=str)
        return value


def device_name(device: str) -> str:
    return (
        torch.cuda.get_device_name(torch.device(device)) if cuda(device) else f"cpu ({machine()})"
    )


def fmt(value: float | None, spec: str = ".2f", unit: str = " ms") -> str:
    """``value`` formatted, or ``n/a`` (a GPU-only reading on a CPU, an unknown peak)."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def percent(share: float | None) -> str:
    return fmt(None if share is None else 100 * share, ".1f", " %")


def table(data: dict[str, Any]) -> str:
    """The Markdown table of the targets' readings (the layout of the first H200 table)."""
    lines = [markdown_header("target", "what", "wall", "GPU busy", "note")]
    n = data["args"]["n"]
    for name in TARGETS:
        found = data.get(name) or {}
        d = found.get("decode") or {}
        ar = d.get("ar_wall_ms")
        if d:
            copy = f"{d['weight_GB']:.2f} GB / {data['copy_GBps']:.0f} GB/s copy"
            floor = f"memory-bound AR step ({copy})"
            busy = f"GPU busy {percent(d['ar_gpu_busy_share'])}; CPU ops {d['ar_cpu_ms']:.1f} ms"
            cold = f"{d['first_visit_penalty']:.2f}x the warm step"
            lines += [
                markdown_row([name, floor, "-", fmt(d["memory_bound_step_ms"]), "the floor"]),
                markdown_row(
                    [name, "AR step, lengths seen before", fmt(ar), fmt(d["ar_gpu_ms"]), busy]
                ),
                markdown_row(
                    [name, "AR step, lengths not seen before", fmt(d["ar_cold_wall_ms"]), "-", cold]
                ),
            ]
            if "compiled_ar_wall_ms" in d:
                busy = (
                    f"GPU busy {percent(d['compiled_ar_gpu_busy_share'])}; {d['compiled_engine']}"
                )
                cold = f"{d['compiled_first_visit_penalty']:.2f}x the warm step"
                lines += [
                    markdown_row([name, "AR step, compiled", fmt(d["compiled_ar_wall_ms"]),
                                  fmt(d["compiled_ar_gpu_ms"]), busy]),
                    markdown_row([name, "AR step, compiled, new lengths",
                                  fmt(d["compiled_ar_cold_wall_ms"]), "-", cold]),
                ]  # fmt: skip
        for kind, c in (found.get("cycle") or {}).items():
            rank = f" r={c['rank']}" if c["rank"] > 1 else ""
            what = f"{n}-draft cycle, {KIND_NAMES.get(kind, kind)}{rank}"
            steps = f"; {c['wall_ms'] / ar:.2f} AR steps" if ar else ""
            note = f"{c['tokens_per_step']:.1f} tokens/cycle{steps}"
            lines.append(markdown_row([name, what, fmt(c["wall_ms"]), fmt(c["gpu_ms"]), note]))
            if c.get("compiled"):
                k = c["compiled"]
                note = f"{k['tokens_per_step']:.1f} tokens/cycle"
                lines.append(
                    markdown_row([name, f"{what}, compiled", fmt(k["wall_ms"]), fmt(k["gpu_ms"]),
                                  note])
                )  # fmt: skip
        for t in found.get("train") or []:
            what = f"training step, {t['bytes']:,} bytes, {t['precision']}"
            peak = fmt(t["peak_GB"], ".1f", " GB")
            note = f"{t['bytes_per_s']:,.0f} bytes/s, peak {peak}, MFU {percent(t['mfu'])}"
            lines.append(markdown_row([name, what, fmt(t["step_s"], ".3f", " s"), "-", note]))
    return "\n".join(lines)


def run_target(name: str, args: argparse.Namespace, report: Report) -> None:
    """Every part of ``args.parts`` but ``batch`` on target ``name`` (loaded once)."""
    found: dict[str, Any] = {}
    report.data[name] = found
    if name == "evabyte" and args.evabyte_code is None:
        found["skipped"] = "no EvaByte remote code (--evabyte-code DIR or MTPC_EVABYTE_CODE)"
        print(f"SKIPPED {name}: {found['skipped']}", flush=True)
        return
    backbone = report.run(f"{name}/load", lambda: load_target(name, args))
    if backbone is None:
        return
    found["attention"] = getattr(backbone, "attention_path", None) or str(
        getattr(backbone.hf_model.config, "_attn_implementation", "?")
    )
    if "decode" in args.parts:
        copy = report.data.get("copy_GBps", float("nan"))
        report.run(f"{name}/decode", lambda: measure_decode(backbone, args, copy), found)
    if "cycle" in args.parts:
        cycles: dict[str, Any] = {}
        found["cycle"] = cycles
        for kind in args.kinds:
            report.run(
                f"{name}/cycle/{kind}", lambda k=kind: measure_cycle(backbone, args, k), cycles
            )
    if "train" in args.parts:  # last: LoRA is attached to the backbone's layers
        peak = peak_tflops(args, report.data["device"])
        report.run(f"{name}/train", lambda: measure_train(backbone, args, peak), found)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add = parser.add_argument
    add("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    add("--targets", default=",".join(TARGETS), help=f"comma-separated, of {TARGETS}")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", help="the targets' dtype (and the decoding heads')")
    add("--evabyte-code", type=Path, default=os.environ.get("MTPC_EVABYTE_CODE") or None,
        help="a folder with EvaByte's evabyte_hf/*.py (default $MTPC_EVABYTE_CODE)")  # fmt: skip
    add("--attention-impl", default="auto", help="EvaByte's model.attention_impl")
    add("--compile", default=None, choices=["inductor", "aot_eager", "eager", "none"],
        help="the compiled engine's backend for its readings (compile=); none: skipped "
             "(default: inductor on CUDA, none on a CPU)")  # fmt: skip
    for flag in SIZE_FLAGS:
        add(f"--{flag.replace('_', '-')}", type=int, default=None, help="size override")
    add("--n", type=int, default=16, help="draft window")
    add("--rank", type=int, default=32, help="CP / BTree rank")
    add("--kinds", default="ff,cp,btree", help="the cycle part's heads")
    add("--prompt-len", type=int, default=512)
    add("--steps", type=int, default=32, help="AR steps and cycles per timed generation")
    add("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth tensor")
    add("--batch-sizes", default="1,16,64")
    add("--batch-prompts", type=int, default=64)
    add("--batch-new", type=int, default=128)
    add("--train-lengths", default="2048,8192", help="row lengths in bytes")
    add("--train-steps", type=int, default=3, help="timed steps (after one warm-up)")
    add("--precisions", default=",".join(PRECISIONS), help=f"of {PRECISIONS}")
    add("--loss-chunk", type=int, default=1024, help="loss.chunk_size")
    add("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak")
    add("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    for key, allowed in (("parts", PARTS), ("targets", TARGETS), ("precisions", PRECISIONS)):
        setattr(args, key, [v for v in getattr(args, key).split(",") if v])
        if not set(getattr(args, key)) <= set(allowed):
            parser.error(f"--{key} is {getattr(args, key)}; allowed: {list(allowed)}")
    if cuda(args.device) and not torch.cuda.is_available():
        parser.error(f"--device is {args.device!r} but torch sees no CUDA GPU; allowed: cpu")
    args.kinds = args.kinds.split(",")
    args.compile = args.compile or ("inductor" if cuda(args.device) else "none")
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    args.train_lengths = [int(v) for v in args.train_lengths.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the parts, prints the tables; 1 when a part failed (the report is still whole)."""
    args = parse(argv)
    report = Report(args)
    report.run("copy_GBps", lambda: copy_bandwidth(args.device, args.copy_mib))
    for name in args.targets if set(args.parts) - {"batch"} else ():
        run_target(name, args, report)
        gc.collect()  # the target's weights, before the next one loads
        if cuda(args.device):
            torch.cuda.empty_cache()
    if "batch" in args.parts:
        report.run("batch", lambda: measure_batch(args))
    print(f"\n{report.data['device']}, {args.dtype}, random weights, torch {torch.__version__}\n")
    print(table(report.data))
    if report.data.get("batch"):
        print("\ntiny target, batched decoding (greedy):\n")
        print(bench_batch.table_decoding(report.data["batch"]))
    for name, error in report.data["errors"].items():
        print(f"FAILED {name}: {error}")
    write_json(args.out, report.data, default=str)
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
