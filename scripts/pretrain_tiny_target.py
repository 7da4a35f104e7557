"""Pretrains the bundled tiny target and writes ``assets/tiny_target/``.

Exact command (repository root, inside the virtualenv)::

    python scripts/pretrain_tiny_target.py

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
import math
import random
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from mtpc.backbones.codecs import get_codec
from mtpc.backbones.tiny import (
    NUM_MTP_HEADS,
    REBUILD_COMMAND,
    REPO_ROOT,
    TINY_TARGET_DIR,
    build_tiny_config,
    encode_chats,
    save_tiny_target,
    tiny_generation_config,
    validation_metrics,
)
from mtpc.data.synthetic import DEFAULT_NUM_ROWS, MULTI_ANSWER_QUESTIONS, load_synthetic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=TINY_TARGET_DIR, help="asset folder to write")
    p.add_argument("--cache-dir", type=Path, default=None, help="synthetic data cache")
    p.add_argument("--num-rows", type=int, default=DEFAULT_NUM_ROWS)
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
    p.add_argument("--eval-generations", type=int, default=200, help="greedy answers scored")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    for name in ("num_rows", "steps", "batch_size", "seq_len", "threads", "hidden_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
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


def _portable(value: object) -> object:
    """Paths inside the repository are recorded relative to it (no machine paths)."""
    if not isinstance(value, Path):
        return value
    try:
        return str(value.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(value)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    command = " ".join(
        ["python", "scripts/pretrain_tiny_target.py", *map(shlex.quote, sys.argv[1:])]
    )
    print(f"command: {command}", flush=True)

    data = load_synthetic(args.cache_dir, num_rows=args.num_rows, seed=args.seed)
    train_rows, val_rows = list(data["train"]), list(data["validation"])
    encoded = encode_chats(train_rows)
    print(f"train rows {len(train_rows)} ({sum(len(i) for i, _ in encoded)} ids), "
          f"validation rows {len(val_rows)}", flush=True)  # fmt: skip

    config = build_tiny_config(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
    )
    model = LlamaForCausalLM(config)
    vocab, d = config.vocab_size, config.hidden_size
    extra = torch.nn.Parameter(
        torch.randn(((NUM_MTP_HEADS - 1) * vocab, d)) * config.initializer_range
    )
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

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(args.seed)
    epoch, cursor = 0, 0
    ids_all, mask_all = packed_epoch(encoded, args.seq_len, generator)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
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
            group["lr"] = lr_at(step)
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
                  f"{losses[0].item():.4f} head7 {losses[-1].item():.4f} lr {lr_at(step):.2e} "
                  f"{elapsed:.0f}s", flush=True)  # fmt: skip
    train_seconds = time.perf_counter() - start

    model.eval()
    mtp_unembeddings = torch.cat([model.lm_head.weight, extra]).detach().clone()  # (8 * V, d)
    metrics = validation_metrics(model, val_rows, mtp_unembeddings)
    metrics.update(greedy_accuracy(model, val_rows, args.eval_generations))
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}", flush=True)
    num_params = sum(p.numel() for p in model.parameters())
    metadata = {
        "command": command,
        "rebuild_command": REBUILD_COMMAND,
        "args": {k: _portable(v) for k, v in vars(args).items()},
        "steps": args.steps,
        "epochs_seen": epoch + cursor / len(ids_all),
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_wall_seconds": round(train_seconds, 1),
        "num_parameters": num_params,
        "num_parameters_with_mtp": num_params + extra.numel(),
        "validation": {"num_rows": len(val_rows), **metrics},
        "torch_version": torch.__version__,
    }
    out = save_tiny_target(model, mtp_unembeddings, args.out, metadata)
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s total", flush=True)
    return metadata


if __name__ == "__main__":
    main()
