"""Benchmark the data pipeline and project the wall time for the 939,344 Tülu 3 rows.

    python scripts/bench_data.py [--num-rows 20000] [--long-rows 2000] [--codec evabyte]

Measures, on this machine, single process:

1. preprocessing (rows already in memory; validate, chat template, ids to disk, split, validation rows) of the
   synthetic set (``mtpc.data.synthetic``; short rows), and the cache hit that follows;
2. the same on Tülu-length rows: synthetic filler conversations whose rendered lengths follow
   a log-normal with mean ``--mean-bytes`` (2,500 by default, an assumption) and 3.6 % of
   rows above 8,192 bytes (the paper's 34,067 / 939,344), from memory and from a JSONL file;
3. packing 905,277 documents (the paper's kept rows) of that length distribution into
   8,192-id sequences;
4. materialising packed sequences with windows (``PackedDataset.__getitem__``).

The projection fits time per row = a + b * bytes through runs 1 and 2 and applies it to
939,344 rows of the assumed mean length. Prints a Markdown report.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from benchlib import machine, markdown_header, markdown_row, timed

from mtpc.backbones.codecs import get_codec
from mtpc.data.cache import load_prepared, prepare
from mtpc.data.datamodule import PackedDataset
from mtpc.data.packing import plan_packing
from mtpc.data.sources import RowSource, local_source, synthetic_source

TULU3_ROWS = 939_344
TULU3_KEPT = 905_277
TULU3_TOO_LONG_SHARE = 34_067 / 939_344
WORDS = ("the", "of", "and", "to", "in", "is", "you", "that", "it", "for", "was", "on", "are")


def lognormal_params(
    mean: float, limit: float = 8192, tail: float = TULU3_TOO_LONG_SHARE
) -> tuple[float, float]:
    """(mu, sigma) of a log-normal with the given mean and P(X > limit) = tail (small sigma)."""
    z = _probit(1 - tail)
    lowest = limit * math.exp(-z * z / 2)  # below it, no sigma solves the two equations
    if mean < lowest:
        raise ValueError(
            f"no log-normal has mean {mean:g} and P(X > {limit:g}) = {tail:.3f}: "
            f"the mean must be at least {math.ceil(lowest)}"
        )
    # ln(limit) - mu = z sigma and mu = ln(mean) - sigma^2 / 2
    c = math.log(limit) - math.log(mean)
    sigma = (2 * z - math.sqrt(4 * z * z - 8 * c)) / 2
    return math.log(mean) - sigma * sigma / 2, sigma


def _probit(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def long_rows(n: int, mean: float, seed: int = 0) -> list[dict]:
    """Filler conversations with Tülu-like rendered lengths (20 % prompt, 80 % answer)."""
    mu, sigma = lognormal_params(mean)
    rng = random.Random(seed)
    lengths = np.random.default_rng(seed).lognormal(mu, sigma, n)
    text = " ".join(rng.choice(WORDS) for _ in range(20_000))
    rows = []
    for i, length in enumerate(lengths.tolist()):
        body = max(int(length) - 90, 8)  # ~90 template ids
        start = rng.randrange(0, len(text) - body - 1) if body < len(text) - 1 else 0
        user = text[start : start + body // 5] or "q"
        answer = (text * (1 + body // len(text)))[start : start + body - len(user)] or "a"
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append({"id": f"long-{i}", "messages": messages, "source": f"long/{i % 18}"})
    return rows


def timed_prepare(source: RowSource, codec: str, cache: Path) -> tuple[float, Path]:
    """Seconds to prepare ``source`` and read it back, and the cache folder."""

    def run() -> Path:
        folder = prepare(source, codec, cache)
        load_prepared(folder)
        return folder

    return timed(run)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-rows", type=int, default=20_000, help="synthetic rows")
    parser.add_argument("--long-rows", type=int, default=5_000, help="Tülu-length rows")
    parser.add_argument(
        "--mean-bytes", type=float, default=2_500.0, help="assumed Tülu 3 mean row length"
    )
    parser.add_argument("--codec", default="evabyte")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--pack-docs", type=int, default=TULU3_KEPT)
    args = parser.parse_args()
    try:
        lognormal_params(args.mean_bytes)
    except ValueError as err:
        parser.error(f"--mean-bytes: {err}")
    torch.set_num_threads(1)
    cache = Path(tempfile.mkdtemp(prefix="mtpc-bench-"))
    try:
        src = synthetic_source(args.num_rows, seed=0)
        t_syn, folder = timed_prepare(src, args.codec, cache)
        syn = load_prepared(folder).summary
        t_hit, _ = timed_prepare(src, args.codec, cache)

        long_src_rows = long_rows(args.long_rows, args.mean_bytes)
        long_src = RowSource(
            "long",
            f"bench-long:{args.long_rows}:{args.mean_bytes}",
            lambda: iter(long_src_rows),
            len(long_src_rows),
            lambda ps: [long_src_rows[p] for p in ps],
        )
        t_long, long_folder = timed_prepare(long_src, args.codec, cache)
        long_data = load_prepared(long_folder)
        jsonl = cache / "long.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in long_src_rows))
        t_jsonl, _ = timed_prepare(local_source(jsonl), args.codec, cache)
        lng = long_data.summary
        # rendered ids of every row read (kept or not), to fit time per row = a + b * bytes
        codec = get_codec(args.codec)
        seen_bytes = {
            name: sum(len(codec.apply_chat_template(r["messages"]).ids) for r in rows)
            for name, rows in (("syn", list(src)), ("long", long_src_rows))
        }
        per_row = {"syn": t_syn / syn["rows_seen"], "long": t_long / lng["rows_seen"]}
        mean_b = {
            "syn": seen_bytes["syn"] / syn["rows_seen"],
            "long": seen_bytes["long"] / lng["rows_seen"],
        }
        b = (per_row["long"] - per_row["syn"]) / (mean_b["long"] - mean_b["syn"])
        a = per_row["syn"] - b * mean_b["syn"]
        projected = TULU3_ROWS * (a + b * args.mean_bytes)

        mu, sigma = lognormal_params(args.mean_bytes)
        lengths = (
            np.random.default_rng(1)
            .lognormal(mu, sigma, int(args.pack_docs * 1.05))
            .astype(np.int64)
        )
        lengths = lengths[(lengths >= 1) & (lengths <= args.seq_len)][: args.pack_docs]
        t_pack, plan = timed(lambda: plan_packing(lengths, args.seq_len))

        dataset = PackedDataset(long_data, "train", args.seq_len, args.window, pad_id=0)
        count = min(len(dataset), 50)
        t_item = timed(lambda: [dataset[k] for k in range(count)])[0] / count
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    print(f"Machine: {machine()}, torch threads 1, single process; codec {args.codec}\n")
    print(markdown_header("run", "rows", "mean ids/row (kept)", "seconds", "rows/s",
                          "MB/s (kept ids)"))  # fmt: skip
    for name, summary, seconds in (
        ("synthetic, prepare", syn, t_syn),
        (f"Tülu-length (mean {args.mean_bytes:,.0f} B), prepare", lng, t_long),
        ("same rows read from a JSONL file, prepare", lng, t_jsonl),
    ):
        rows, nbytes = summary["rows_seen"], summary["used_bytes"]
        print(markdown_row([name, f"{rows:,}", f"{nbytes / rows:,.0f}", f"{seconds:.2f}",
                            f"{rows / seconds:,.0f}", f"{nbytes / seconds / 1e6:.2f}"]))  # fmt: skip
    print(f"\nCache hit (second run, synthetic): {t_hit:.3f} s")
    print(
        f"Long rows dropped as too_long: {lng['dropped']['too_long']} of {lng['rows_seen']} "
        f"({lng['dropped']['too_long'] / lng['rows_seen']:.1%}; paper: {TULU3_TOO_LONG_SHARE:.1%})"
    )
    print(f"\nFit: seconds per row = {a * 1e6:.1f} us + {b * 1e9:.1f} ns/byte")
    print(
        f"Projected preprocessing of {TULU3_ROWS:,} Tülu 3 rows at {args.mean_bytes:,.0f} B/row: "
        f"{projected:,.0f} s = {projected / 60:.1f} min (single process)"
    )
    print(
        f"\nPacking {len(lengths):,} documents into L={args.seq_len}: {t_pack:.1f} s, "
        f"{plan.num_sequences:,} sequences, fill {plan.fill_ratio():.4f}"
    )
    print(
        f"PackedDataset item (L={args.seq_len}, n={args.window}): {t_item * 1e3:.2f} ms "
        f"= {1 / t_item:,.0f} sequences/s per worker = {args.seq_len / t_item / 1e6:.1f} M positions/s"
    )


if __name__ == "__main__":
    main()
