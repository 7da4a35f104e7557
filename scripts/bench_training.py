"""Training-step cost of MTPC drafts vs plain STP fine-tuning, on the tiny target (CPU).

Exact command (repository root, inside the virtualenv)::

    python scripts/bench_training.py

For each circuit family (ff, cp, hmm, btree) at n = 16, r = 32 (ff: r = 1), k in {0, 1}, and for
the reference — next-byte (STP) fine-tuning of the last transformer layer and the
unembedding — one optimizer step (forward, backward, Adam) on the same packed synthetic
batch is timed (minimum over rounds) and its peak resident memory measured in a fresh
process (``VmHWM`` after a reset, minus the resident size before the step). Reported:
tokens/s (positions per second), step time relative to STP, peak extra MiB.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from benchlib import (
    best_time,
    in_fresh_process,
    markdown_header,
    markdown_row,
    peak_rss_extra_mb,
    write_json,
)

FAMILIES = ("ff", "cp", "hmm", "btree")


def _batch(seq_len: int, batch_size: int, window: int, cache_dir: str | None) -> dict[str, Any]:
    from mtpc.data.datamodule import build_datamodule

    datamodule = build_datamodule(
        source="synthetic", codec="tiny", seq_len=seq_len, window=window,
        batch_size=batch_size, num_rows=2000, cache_dir=cache_dir,
    )  # fmt: skip
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def _step_fn(kind: str, rank: int, lora: int, window: int, batch: dict[str, Any]) -> Any:
    """A closure running one optimizer step of the configured training."""
    from mtpc.model import MTPCModel
    from mtpc.training.module import MTPCLightningModule

    if kind == "stp":
        from mtpc.backbones.tiny import load_tiny_target

        model = load_tiny_target().model
        for p in model.parameters():
            p.requires_grad_(False)
        last = model.model.layers[-1]
        params = [*last.parameters(), model.lm_head.weight]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=3e-4)
        ids, mask = batch["input_ids"], batch["target_mask"][..., 0]

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            logits = model(ids).logits[:, :-1]  # (B, L-1, V)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            (loss * mask[:, :-1].reshape(-1)).sum().backward()
            optimizer.step()

        return step
    draft = MTPCModel.from_config(
        model="tiny", kind=kind, window=window, rank=rank, lora_layers=lora
    )
    module = MTPCLightningModule(draft, chunk_size=1024)
    optimizer = module.configure_optimizers()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module._objective(batch)[0].loss.backward()
        optimizer.step()

    return step


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's step time and peak extra memory (run in a fresh process)."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    batch = _batch(spec["seq_len"], spec["batch_size"], spec["window"], spec["cache_dir"])
    step = _step_fn(spec["kind"], spec["rank"], spec["lora"], spec["window"], batch)
    step()  # allocate Adam state, warm up
    peak_mb = peak_rss_extra_mb(step)
    seconds = best_time(step, min_time=0.0, warmup=0, rounds=spec["rounds"])
    tokens = batch["input_ids"].numel()
    return {**spec, "step_s": seconds, "tokens_s": tokens / seconds, "peak_extra_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    base = {
        "window": args.window, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "rounds": args.rounds, "threads": args.threads, "cache_dir": args.cache_dir,
    }  # fmt: skip
    specs = [{**base, "kind": "stp", "rank": 0, "lora": 0}]
    specs += [
        {**base, "kind": kind, "rank": 1 if kind == "ff" else args.rank, "lora": lora}
        for kind in FAMILIES
        for lora in (0, 1)
    ]
    rows = [in_fresh_process(measure, spec) for spec in specs]
    stp = rows[0]["step_s"]
    print(
        f"tiny target, B={args.batch_size} x L={args.seq_len}, n={args.window}, "
        f"threads={args.threads}"
    )
    print(markdown_header("draft", "r", "k", "step ms", "tokens/s", "x STP step time",
                          "peak extra MiB"))  # fmt: skip
    for row in rows:
        stp_row = row["kind"] == "stp"
        print(markdown_row([
            "STP (last layer + unembedding)" if stp_row else row["kind"],
            "-" if stp_row else row["rank"], "-" if stp_row else row["lora"],
            f"{row['step_s'] * 1e3:.1f}", f"{row['tokens_s']:.0f}",
            f"{row['step_s'] / stp:.2f}", f"{row['peak_extra_mb']:.1f}",
        ]))  # fmt: skip
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
