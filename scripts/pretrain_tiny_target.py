"""Pretrains a bundled tiny target: ``assets/tiny_target/`` (synthetic chat) or
``assets/tiny_code/`` (Python source code).

Exact commands (repository root, inside the virtualenv)::

    python scripts/pretrain_tiny_target.py
    python scripts/pretrain_tiny_target.py --data python_code   # + the sizes in assets/tiny_code/metadata.json

``--data python_code`` trains on the rows of ``mtpc.data.python_code`` (the running
interpreter's standard library: function bodies, docstrings, continuations), split by file;
held-out files are scored (bits per byte over ``--eval-windows`` packed windows of held-out
rows), a few held-out functions are completed greedily (samples and the share whose
completion parses land in ``metadata.json``), and the weights are stored in
``--store-dtype`` (bfloat16 by default for this target, to keep ``assets/`` small).

A ``LlamaForCausalLM`` with EvaByte's vocabulary layout (320 ids) is trained on the
synthetic chat data (``mtpc.data.synthetic``, 20k rows, seed 0) rendered with EvaByte's
chat template and packed into sequences of ``--seq-len`` ids. The loss is the next-byte
loss plus the mean loss of 7 extra fully factorised MTP unembeddings (block k predicts the
byte t+1+k from the same final hidden state), trained jointly with the shared trunk as
EvaByte's MTP heads are; ``--loss-on`` picks every byte (default) or only assistant bytes.
At the end the validation split is scored (loss, bits per byte, per-head MTP loss) and a
sample of validation prompts is answered greedily; everything lands in ``metadata.json``.
Seeded and deterministic for a given machine and thread count.

Time: 1500 steps of 4 x 512 ids take about 0.23 s each on 2 idle CPU cores (about 6
minutes); the shipped assets took 29 minutes (1556 CPU-seconds) because the 2 cores were
shared with other jobs at a load average of 3-6.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from mtpc.backbones.codecs import ByteCodec, get_codec
from mtpc.backbones.tiny import (
    MTP_KEY,
    NUM_MTP_HEADS,
    REBUILD_COMMAND,
    REPO_ROOT,
    TINY_CODE_DIR,
    TINY_TARGET_DIR,
    WEIGHT_FILES,
    sha256_file,
)
from mtpc.data.synthetic import DEFAULT_NUM_ROWS, MULTI_ANSWER_QUESTIONS, load_synthetic

DATA_CHOICES = ("synthetic", "python_code")


def build_tiny_config(
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 352,
    max_position_embeddings: int = 1024,
) -> LlamaConfig:
    """A Llama config with EvaByte's vocabulary (320 ids) and special ids (ValueError: a size
    is not positive, or ``hidden_size`` is not divisible by ``num_heads``)."""
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    codec = get_codec("tiny")
    return LlamaConfig(
        vocab_size=codec.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
        tie_word_embeddings=False,
    )


def tiny_generation_config() -> GenerationConfig:
    """Greedy by default; stops at ``<|eot_id|>`` (11) or ``<eos>`` (2)."""
    codec = get_codec("tiny")
    return GenerationConfig(
        bos_token_id=codec.bos_id,
        eos_token_id=list(codec.stop_ids),
        pad_token_id=codec.pad_id,
        do_sample=False,
    )


def save_tiny_target(
    model: LlamaForCausalLM,
    mtp_unembeddings: torch.Tensor,
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
) -> Path:
    """Writes the asset folder (see ``mtpc.backbones.tiny``'s docstring); returns its path.
    ``mtp_unembeddings`` (8 * V, d): block 0 must equal ``model.lm_head.weight``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = model.config.vocab_size
    if not torch.equal(mtp_unembeddings[:vocab], model.lm_head.weight):
        raise ValueError("mtp_unembeddings block 0 must equal model.lm_head.weight")
    model.generation_config = tiny_generation_config()
    model.save_pretrained(path)
    mtp = mtp_unembeddings.detach().contiguous().cpu()
    save_file({MTP_KEY: mtp}, path / "mtp_heads.safetensors")
    meta = {**metadata, "sha256": {name: sha256_file(path / name) for name in WEIGHT_FILES}}
    (path / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path


def encode_chats(
    rows: Sequence[Mapping[str, Any]], codec: ByteCodec | None = None
) -> list[tuple[list[int], list[bool]]]:
    """Renders Tülu-format rows with the chat template: (ids, assistant mask) per row."""
    codec = get_codec("tiny") if codec is None else codec
    encodings = [codec.apply_chat_template(row["messages"]) for row in rows]
    return [(enc.ids, enc.assistant_mask) for enc in encodings]


@torch.no_grad()
def validation_metrics(
    model: LlamaForCausalLM,
    rows: Sequence[Mapping[str, Any]],
    mtp_unembeddings: torch.Tensor | None = None,
    batch_size: int = 32,
) -> dict[str, float]:
    """Next-byte loss of ``model`` on chat rows, one row per sequence (no packing). Returns
    ``loss`` / ``bits_per_byte`` (mean NLL, nats / bits, every target after the first id),
    ``assistant_loss`` / ``assistant_bits_per_byte`` (assistant bytes and their ``<|eot_id|>``)
    and, with ``mtp_unembeddings``, ``mtp_loss_k`` (head k, byte t+1+k)."""
    model.eval()
    device = next(model.parameters()).device
    encoded = sorted(encode_chats(rows), key=lambda e: len(e[0]))  # little padding per batch
    pad = get_codec("tiny").pad_id  # padded positions are masked out anyway
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def add(key: str, nll: torch.Tensor, mask: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0.0) + float((nll * mask).sum())
        counts[key] = counts.get(key, 0.0) + float(mask.sum())

    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        rows_ids = [torch.tensor(row_ids) for row_ids, _ in chunk]
        masks = [torch.tensor(row_mask, dtype=torch.bool) for _, row_mask in chunk]
        ids = pad_sequence(rows_ids, batch_first=True, padding_value=pad).to(device)  # (B, T)
        valid = pad_sequence([torch.ones_like(m) for m in masks], batch_first=True).to(device)
        assistant = pad_sequence(masks, batch_first=True).to(device)  # (B, T)
        out = model.model(input_ids=ids, attention_mask=valid.long())
        hidden = out.last_hidden_state  # (B, T, d)
        log_probs = model.lm_head(hidden).float().log_softmax(-1)  # (B, T, V)
        nll = -log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
        add("loss", nll, valid[:, 1:])
        add("assistant_loss", nll, assistant[:, 1:])
        if mtp_unembeddings is not None:
            logits = hidden.float() @ mtp_unembeddings.float().to(device).T  # (B, T, K * V)
            mtp = logits.unflatten(-1, (NUM_MTP_HEADS, -1)).log_softmax(-1)  # (B, T, K, V)
            for k in range(1, mtp.shape[2]):
                nll_k = -mtp[:, : -1 - k, k].gather(-1, ids[:, 1 + k :, None])[..., 0]  # (B, T-1-k)
                add(f"mtp_loss_{k}", nll_k, valid[:, 1 + k :])
    metrics = {key: sums[key] / max(counts[key], 1.0) for key in sums}
    metrics["bits_per_byte"] = metrics["loss"] / math.log(2)
    metrics["assistant_bits_per_byte"] = metrics["assistant_loss"] / math.log(2)
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", choices=DATA_CHOICES, default="synthetic", help="training rows")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="asset folder to write (default: assets/tiny_target, or assets/tiny_code with "
        "--data python_code)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="synthetic data cache")
    p.add_argument(
        "--num-rows",
        type=int,
        default=None,
        help=f"synthetic: rows to generate (default {DEFAULT_NUM_ROWS}); python_code: the first "
        "N rows (default: every row)",
    )
    p.add_argument(
        "--code-root",
        type=Path,
        default=None,
        help="python_code: a folder of .py files instead of the standard library",
    )
    p.add_argument(
        "--validation-fraction", type=float, default=0.1, help="python_code: held-out files"
    )
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument(
        "--store-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="dtype of the stored weights (default: float32 for synthetic, bfloat16 for "
        "python_code)",
    )
    p.add_argument(
        "--eval-windows",
        type=int,
        default=256,
        help="python_code: packed held-out windows of --seq-len scored (evenly spaced)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=1.0, help="weight of the mean MTP loss")
    p.add_argument("--loss-on", choices=("all", "assistant"), default="all")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=352)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop training after this many seconds; the cosine schedule then runs on time "
        "(ends at the budget or at --steps, whichever comes first), so the steps depend on "
        "the machine's speed",
    )
    p.add_argument("--eval-generations", type=int, default=200, help="greedy answers scored")
    p.add_argument("--log-every", type=int, default=50)
    return _checked(p, p.parse_args(argv))


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked (``p.error`` exits with one line) and the ``--data`` defaults filled."""
    for name in ("steps", "batch_size", "seq_len", "threads", "hidden_size", "eval_windows"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_rows is not None and args.num_rows <= 0:
        p.error(f"--num-rows must be positive, got {args.num_rows}")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        p.error(f"--time-budget-s must be positive, got {args.time_budget_s}")
    if args.seq_len > args.max_position_embeddings:
        p.error(
            f"--seq-len {args.seq_len} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}"
        )
    code = args.data == "python_code"
    if args.out is None:
        args.out = TINY_CODE_DIR if code else TINY_TARGET_DIR
    if args.store_dtype is None:
        args.store_dtype = "bfloat16" if code else "float32"
    if args.num_rows is None and not code:
        args.num_rows = DEFAULT_NUM_ROWS
    return args


def packed_epoch(
    encoded: list[tuple[list[int], list[bool]]], seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffles the conversations, concatenates them and cuts (N, seq_len) ids and masks."""
    order = torch.randperm(len(encoded), generator=generator).tolist()
    ids = [i for j in order for i in encoded[j][0]]
    mask = [m for j in order for m in encoded[j][1]]
    n = len(ids) // seq_len
    return (
        torch.tensor(ids[: n * seq_len]).view(n, seq_len),
        torch.tensor(mask[: n * seq_len]).view(n, seq_len),
    )


def mtp_loss(
    hidden: torch.Tensor, unembeddings: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> list[torch.Tensor]:
    """Cross-entropy of each of the K heads; head k predicts ids[:, t + 1 + k].

    Args:
        hidden: (B, T, d) final hidden states.
        unembeddings: (K * V, d).
        ids: (B, T) input ids.
        weights: (B, T) float weight of each position as a target.
    """
    logits = (hidden @ unembeddings.T).unflatten(-1, (NUM_MTP_HEADS, -1))  # (B, T, K, V)
    losses = []
    for k in range(NUM_MTP_HEADS):
        pred = logits[:, : -1 - k, k]  # (B, T-1-k, V)
        target, w = ids[:, 1 + k :], weights[:, 1 + k :]  # (B, T-1-k)
        nll = F.cross_entropy(pred.flatten(0, 1), target.flatten(), reduction="none")
        losses.append((nll * w.flatten()).sum() / w.sum().clamp_min(1.0))
    return losses


@torch.no_grad()
def greedy_accuracy(model: LlamaForCausalLM, rows: list[dict], limit: int) -> dict[str, float]:
    """Greedy answers to the last user turn of validation rows, scored per family.

    Single-answer families count an exact match with the reference; multi-answer questions
    count an answer from the valid set.
    """
    codec = get_codec("tiny")
    valid_answers = dict(MULTI_ANSWER_QUESTIONS)
    hits: dict[str, list[int]] = {}
    generation_config = tiny_generation_config()
    generation_config.max_new_tokens = 80
    for row in rows[:limit]:
        messages = row["messages"]
        prompt = codec.generation_prompt(messages[:-1])
        out = model.generate(torch.tensor([prompt]), generation_config=generation_config)
        answer = codec.decode(out[0, len(prompt) :])
        family = row["source"].split("/")[-1]
        reference = messages[-1]["content"]
        question = messages[-2]["content"]
        ok = answer in valid_answers[question] if family == "multi_answer" else answer == reference
        hits.setdefault(family, []).append(int(ok))
    acc = {f"greedy_acc/{f}": sum(v) / len(v) for f, v in sorted(hits.items())}
    acc["greedy_acc/all"] = sum(sum(v) for v in hits.values()) / max(
        1, sum(map(len, hits.values()))
    )
    return acc


@torch.no_grad()
def packed_validation(
    model: LlamaForCausalLM,
    encoded: list[tuple[list[int], list[bool]]],
    seq_len: int,
    max_windows: int,
    mtp_unembeddings: torch.Tensor,
    batch_size: int = 8,
) -> dict[str, float]:
    """Held-out loss over packed windows, as the model was trained (rows back to back).

    The held-out rows are concatenated in their order and cut into windows of ``seq_len``;
    ``max_windows`` evenly spaced windows are scored.

    Returns:
        ``loss`` / ``bits_per_byte`` over every target id, ``assistant_loss`` /
        ``assistant_bits_per_byte`` over assistant ids, ``mtp_loss_k`` (k = 1..7) for the
        extra MTP heads, and ``windows`` / ``scored_ids``.
    """
    model.eval()
    ids = torch.tensor([i for e in encoded for i in e[0]])
    mask = torch.tensor([m for e in encoded for m in e[1]])
    n = len(ids) // seq_len
    picked = torch.linspace(0, n - 1, min(n, max_windows)).round().long().unique()
    ids = ids[: n * seq_len].view(n, seq_len)[picked]  # (W, T)
    mask = mask[: n * seq_len].view(n, seq_len)[picked]  # (W, T)
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for start in range(0, len(ids), batch_size):
        x, m = ids[start : start + batch_size], mask[start : start + batch_size]  # (B, T)
        hidden = model.model(input_ids=x).last_hidden_state.float()  # (B, T, d)
        logits = (hidden @ mtp_unembeddings.float().T).unflatten(-1, (NUM_MTP_HEADS, -1))
        for k in range(NUM_MTP_HEADS):  # logits: (B, T, K, V)
            nll = F.cross_entropy(
                logits[:, : -1 - k, k].flatten(0, 1), x[:, 1 + k :].flatten(), reduction="none"
            )  # (B * (T-1-k),)
            parts = {f"mtp_loss_{k}" if k else "loss": torch.ones_like(nll)}
            if k == 0:
                parts["assistant_loss"] = m[:, 1:].flatten().float()
            for key, w in parts.items():
                sums[key] = sums.get(key, 0.0) + float((nll * w).sum())
                counts[key] = counts.get(key, 0.0) + float(w.sum())
    metrics = {key: sums[key] / max(counts[key], 1.0) for key in sums}
    metrics["bits_per_byte"] = metrics["loss"] / math.log(2)
    metrics["assistant_bits_per_byte"] = metrics["assistant_loss"] / math.log(2)
    metrics["windows"] = float(len(ids))
    metrics["scored_ids"] = counts["loss"]
    return metrics


@torch.no_grad()
def code_samples(
    model: LlamaForCausalLM, rows: list[dict], limit: int, max_prompt_ids: int = 600
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Greedy bodies of held-out ``python/function_body`` prompts: how many parse, and samples.

    A completion parses when the signature and docstring followed by the greedy body is
    valid Python (an answer cut at ``max_new_tokens`` usually is not).
    """
    import ast

    codec = get_codec("tiny")
    generation_config = tiny_generation_config()
    generation_config.max_new_tokens = 256
    prompts = [
        r for r in rows
        if r["source"] == "python/function_body"
        and len(codec.generation_prompt(r["messages"][:-1])) <= max_prompt_ids
    ][:limit]  # fmt: skip
    parsed, exact = 0, 0
    samples: list[dict[str, str]] = []
    for row in prompts:
        messages = row["messages"]
        prompt = codec.generation_prompt(messages[:-1])
        out = model.generate(torch.tensor([prompt]), generation_config=generation_config)
        answer = codec.decode(out[0, len(prompt) :])
        header = messages[0]["content"].split("\n\n", 1)[1]
        try:
            ast.parse(header + answer)
            parsed += int(bool(answer.strip()))  # an empty body would parse too
        except (SyntaxError, ValueError):
            pass
        exact += int(answer == messages[1]["content"])
        if len(samples) < 3:
            samples.append({"id": row["id"], "prompt": messages[0]["content"],
                            "reference": messages[1]["content"], "greedy": answer})  # fmt: skip
    n = max(1, len(prompts))
    metrics = {
        "greedy_function_body/prompts": float(len(prompts)),
        "greedy_function_body/parses": parsed / n,
        "greedy_function_body/exact": exact / n,
    }
    return metrics, samples


def _portable(value: object) -> object:
    """Paths inside the repository are recorded relative to it (no machine paths)."""
    if not isinstance(value, Path):
        return value
    try:
        return str(value.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(value)


def load_rows(args: argparse.Namespace) -> tuple[list[dict], list[dict], dict]:
    """(train rows, validation rows, the data report for ``metadata.json``: {} for synthetic)."""
    if args.data == "synthetic":
        data = load_synthetic(args.cache_dir, num_rows=args.num_rows, seed=args.seed)
        return list(data["train"]), list(data["validation"]), {}
    from mtpc.data.python_code import python_code_source

    source = python_code_source(args.code_root, args.num_rows, args.validation_fraction)
    rows, held_out = list(source), list(source.split_mask())  # type: ignore[misc]
    train_rows = [r for r, v in zip(rows, held_out, strict=True) if not v]
    val_rows = [r for r, v in zip(rows, held_out, strict=True) if v]
    data_report = {"fingerprint": source.fingerprint, **source.report()}  # type: ignore[misc]
    data_report["root"] = "stdlib" if args.code_root is None else _portable(args.code_root)
    return train_rows, val_rows, data_report


def train(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    extra: torch.nn.Parameter,
    encoded: list[tuple[list[int], list[bool]]],
) -> tuple[int, float, float]:
    """Trains the trunk and the extra MTP unembeddings ``extra`` in place.

    Returns:
        (steps done, epochs seen, training seconds).
    """
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2] + [extra]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int, elapsed: float = 0.0) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        if args.time_budget_s is not None:  # the cosine ends at the budget or at --steps
            progress = max(progress, elapsed / args.time_budget_s)
        progress = min(progress, 1.0)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(args.seed)
    epoch, cursor = 0, 0
    ids_all, mask_all = packed_epoch(encoded, args.seq_len, generator)
    model.train()
    start = time.perf_counter()
    steps_done = 0
    for step in range(args.steps):
        elapsed = time.perf_counter() - start
        if args.time_budget_s is not None and elapsed >= args.time_budget_s:
            print(
                f"time budget of {args.time_budget_s:.0f}s reached after {step} steps", flush=True
            )
            break
        steps_done = step + 1
        if cursor + args.batch_size > len(ids_all):
            epoch, cursor = epoch + 1, 0
            ids_all, mask_all = packed_epoch(encoded, args.seq_len, generator)
        ids = ids_all[cursor : cursor + args.batch_size]  # (B, T)
        mask = mask_all[cursor : cursor + args.batch_size]  # (B, T)
        cursor += args.batch_size
        weights = (
            mask.float() if args.loss_on == "assistant" else torch.ones_like(ids, dtype=torch.float)
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, elapsed)
        hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, d)
        unembeddings = torch.cat([model.lm_head.weight, extra])  # (K * V, d)
        losses = mtp_loss(hidden, unembeddings, ids, weights)
        loss = losses[0] + args.mtp_weight * torch.stack(losses[1:]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), extra], 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step:5d} epoch {epoch} loss {loss.item():.4f} next-byte "
                  f"{losses[0].item():.4f} head7 {losses[-1].item():.4f} lr {lr_at(step, elapsed):.2e} "
                  f"{elapsed:.0f}s", flush=True)  # fmt: skip
    train_seconds = time.perf_counter() - start
    return steps_done, epoch + cursor / len(ids_all), train_seconds


def evaluate(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    val_rows: list[dict],
    mtp_unembeddings: torch.Tensor,
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Held-out metrics, and greedy samples (python_code only)."""
    if args.data == "synthetic":
        metrics = validation_metrics(model, val_rows, mtp_unembeddings)
        metrics.update(greedy_accuracy(model, val_rows, args.eval_generations))
        return metrics, []
    metrics = packed_validation(
        model, encode_chats(val_rows), args.seq_len, args.eval_windows, mtp_unembeddings
    )
    greedy, samples = code_samples(model, val_rows, args.eval_generations)
    metrics.update(greedy)
    return metrics, samples


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    command = " ".join(
        [
            "python",
            "scripts/pretrain_tiny_target.py",
            *map(shlex.quote, sys.argv[1:] if argv is None else argv),
        ]
    )
    print(f"command: {command}", flush=True)

    train_rows, val_rows, data_report = load_rows(args)
    encoded = encode_chats(train_rows)
    print(f"train rows {len(train_rows)} ({sum(len(i) for i, _ in encoded)} ids), "
          f"validation rows {len(val_rows)}", flush=True)  # fmt: skip

    config = build_tiny_config(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
    )
    model = LlamaForCausalLM(config)
    vocab, d = config.vocab_size, config.hidden_size
    extra = torch.nn.Parameter(
        torch.randn(((NUM_MTP_HEADS - 1) * vocab, d)) * config.initializer_range
    )
    start = time.perf_counter()
    steps_done, epochs_seen, train_seconds = train(args, model, extra, encoded)

    model.eval()
    mtp_unembeddings = torch.cat([model.lm_head.weight, extra]).detach().clone()  # (8 * V, d)
    metrics, samples = evaluate(args, model, val_rows, mtp_unembeddings)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}", flush=True)
    for sample in samples:
        print(
            f"--- {sample['id']}\n{sample['prompt']}\n>>> greedy:\n{sample['greedy']}", flush=True
        )
    num_params = sum(p.numel() for p in model.parameters())
    metadata = {
        "command": command,
        "rebuild_command": REBUILD_COMMAND if args.data == "synthetic" else command,
        "args": {k: _portable(v) for k, v in vars(args).items()},
        "steps": steps_done,
        "epochs_seen": epochs_seen,
        "tokens_seen": steps_done * args.batch_size * args.seq_len,
        "train_wall_seconds": round(train_seconds, 1),
        "num_parameters": num_params,
        "num_parameters_with_mtp": num_params + extra.numel(),
        "validation": {"num_rows": len(val_rows), **metrics},
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "stored_dtype": args.store_dtype,
    }
    if data_report:
        metadata["data"] = {"train_rows": len(train_rows), **data_report}
        metadata["greedy_samples"] = samples
    if args.store_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        mtp_unembeddings = torch.cat([model.lm_head.weight, extra.to(torch.bfloat16)]).detach()
    out = save_tiny_target(model, mtp_unembeddings, args.out, metadata)
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s total", flush=True)
    return metadata


if __name__ == "__main__":
    main()
