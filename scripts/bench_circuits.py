"""Benchmark the circuit engine and the MTPC head (CPU, one thread).

Measures, for each family, n in {8, 16}, r in {8, 32}, V = 320, d = 256:

1. batch-1 latency of the head (``head(e)``) and of sample + all n prefix marginals of the
   sampled window (what one speculative-sampling cycle needs from the drafter);
2. forward + backward of the training likelihood (all prefix marginals) at batch B;
3. for CP and BTree, the same with a hand-written single-family reference (below), and the
   ratio generic / reference;

and the peak memory of the chunked likelihood for T = 1k, 2k, 4k, 8k at d = 1024: each T
runs in a fresh subprocess, which resets its peak resident set size (``/proc/self/clear_refs``)
and reports the peak (``VmHWM``) minus
the resident size just before the forward pass (head, hidden states and targets already
allocated), so the number is what forward + backward add on top of the inputs.

    python scripts/bench_circuits.py                   # full table (a few minutes)
    python scripts/bench_circuits.py --train-batch 4096
    python scripts/bench_circuits.py --skip-memory --families btree
"""

from __future__ import annotations

import argparse

import torch
from benchlib import (
    best_time,
    in_fresh_process,
    markdown_header,
    markdown_row,
    peak_rss_extra_mb,
    write_json,
)
from torch import Tensor

from mtpc.circuits.engine import categorical as _categorical
from mtpc.heads import MTPCHead, chunked_log_likelihood

# ---------------------------------------------------------------------------------------------
# Hand-written single-family references (same parameter layout as the generic structures)


class RefCP:
    """CP written by hand: one sum over r fully factorised components."""

    def __init__(self, window: int, rank: int) -> None:
        self.n, self.r = window, rank

    def prefix_from_leaves(self, leaves: Tensor, sum_logw: Tensor) -> Tensor:
        """``leaves (B, n, r)``, ``sum_logw (B, 1, r)`` -> ``(B, n)``."""
        return torch.logsumexp(leaves.cumsum(1) + sum_logw, -1)

    def sample(self, lp: Tensor, sum_logw: Tensor, generator: torch.Generator) -> Tensor:
        z = _categorical(sum_logw[:, 0], generator)  # (B,)
        logits = lp[torch.arange(lp.shape[0]), :, z]  # (B, n, V)
        return _categorical(logits, generator)


class RefBTree:
    """Balanced binary tree written by hand (n a power of two)."""

    def __init__(self, window: int, rank: int) -> None:
        if window & (window - 1):
            raise ValueError("the reference BTree needs a power-of-two window")
        self.n, self.r = window, rank
        self.tri = torch.ones(window, window, dtype=torch.bool).tril().T.unsqueeze(1)
        self.levels = []  # (folds, units, row offset) bottom-up
        off, folds = 0, window // 2
        while folds >= 1:
            units = rank if folds > 1 else 1
            self.levels.append((folds, units, off))
            off += folds * units
            folds //= 2

    def prefix_from_leaves(self, leaves: Tensor, sum_logw: Tensor) -> Tensor:
        B, r, n = leaves.shape[0], self.r, self.n
        h = torch.where(self.tri, leaves.unsqueeze(-1), 0.0)  # (B, n, r, n)
        w = sum_logw.exp()
        for folds, units, off in self.levels:
            h = h[:, 0::2] + h[:, 1::2]  # (B, F, r, n)
            mx = h.detach().amax(2, keepdim=True)
            z = torch.exp(h - mx).reshape(B * folds, r, n)
            wl = w[:, off : off + folds * units].reshape(B * folds, units, r)
            h = torch.bmm(wl, z).view(B, folds, units, n).log() + mx
        return h[:, 0, 0]

    def sample(self, lp: Tensor, sum_logw: Tensor, generator: torch.Generator) -> Tensor:
        B, n, r, V = lp.shape
        z = torch.zeros(B, 1, dtype=torch.long)
        for folds, units, off in reversed(self.levels):
            rows = off + torch.arange(folds) * units + z  # (B, F)
            w = sum_logw.gather(1, rows.unsqueeze(-1).expand(B, folds, r))  # (B, F, r)
            z = _categorical(w, generator).repeat_interleave(2, 1)  # (B, 2F)
        logits = lp.gather(2, z[:, :, None, None].expand(B, n, 1, V)).squeeze(2)
        return _categorical(logits, generator)


REFERENCES = {"cp": RefCP, "btree": RefBTree}

# ---------------------------------------------------------------------------------------------


def bench_config(kind: str, n: int, r: int, V: int, d: int, train_batch: int) -> dict:
    torch.manual_seed(0)
    head = MTPCHead(kind, n, r, V, d)
    with torch.no_grad():
        head.sum_proj.normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    e = torch.randn(1, d)
    row: dict = {"kind": kind, "n": n, "r": r}
    with torch.inference_mode():
        row["head_ms"] = best_time(lambda: head(e)) * 1e3
        params = head(e)
        circ = head.circuit

        def generic() -> None:
            x = circ.sample(params, generator=g)
            circ.prefix_log_prob(params, x)

        row["sample_prefix_ms"] = best_time(generic) * 1e3
        ref_cls = REFERENCES.get(kind)
        if ref_cls is not None:
            ref = ref_cls(n, r)
            lp, lw = params.input_logp, params.sum_logw
            assert lw is not None

            def reference() -> None:
                x = ref.sample(lp, lw, g)
                leaves = lp.gather(3, x[:, :, None, None].expand(1, n, r, 1)).squeeze(3)
                ref.prefix_from_leaves(leaves, lw)

            x = circ.sample(params, generator=g)
            leaves = lp.gather(3, x[:, :, None, None].expand(1, n, r, 1)).squeeze(3)
            torch.testing.assert_close(
                ref.prefix_from_leaves(leaves, lw), circ.prefix_log_prob(params, x)
            )
            row["ref_sample_prefix_ms"] = best_time(reference) * 1e3
            row["ratio_b1"] = row["sample_prefix_ms"] / row["ref_sample_prefix_ms"]

    if train_batch:
        h = torch.randn(train_batch, d)
        t = torch.randint(V, (train_batch, n))

        def train_generic() -> None:
            head.zero_grad(set_to_none=True)
            out = chunked_log_likelihood(head, h, t, chunk_size=train_batch, checkpoint=False)
            out.sum().backward()

        row["train_ms"] = best_time(train_generic, min_time=0.0, warmup=1, rounds=3) * 1e3
        if kind in REFERENCES:
            ref = REFERENCES[kind](n, r)

            def train_ref() -> None:
                head.zero_grad(set_to_none=True)
                lw = head.sum_log_weights(h)
                assert lw is not None
                ref.prefix_from_leaves(head.leaf_log_prob(h, t), lw).sum().backward()

            row["ref_train_ms"] = best_time(train_ref, min_time=0.0, warmup=1, rounds=3) * 1e3
            row["ratio_train"] = row["train_ms"] / row["ref_train_ms"]
    return row


def _memory(T: int, d: int, kind: str, n: int, r: int, V: int, chunk: int) -> dict:
    """Peak extra memory of the chunked likelihood's forward + backward (a fresh process)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = MTPCHead(kind, n, r, V, d)
    hidden = torch.randn(T, d, requires_grad=True)
    targets = torch.randint(V, (T, n))
    peak = peak_rss_extra_mb(
        lambda: chunked_log_likelihood(head, hidden, targets, chunk_size=chunk).sum().backward()
    )
    return {"T": T, "peak_extra_mb": peak, "hidden_mb": T * d * 4 / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", nargs="*", default=["ff", "cp", "hmm", "btree"])
    ap.add_argument("--windows", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument(
        "--train-batch", type=int, default=1024, help="B for forward+backward (0: skip)"
    )
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--mem-T", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--mem-config", default="btree,8,8", help="kind,n,r for the memory run")
    ap.add_argument("--mem-hidden", type=int, default=1024)
    ap.add_argument("--mem-chunk", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(1)

    rows = []
    print(markdown_header("family", "n", "r", "head ms", "sample+prefix ms", "ref ms", "ratio",
                          "train fwd+bwd ms", "ref ms", "ratio"))  # fmt: skip
    keys = ("head_ms", "sample_prefix_ms", "ref_sample_prefix_ms", "ratio_b1", "train_ms",
            "ref_train_ms", "ratio_train")  # fmt: skip
    for kind in args.families:
        for n in args.windows:
            for r in [1] if kind == "ff" else args.ranks:
                row = bench_config(kind, n, r, args.vocab, args.hidden, args.train_batch)
                rows.append(row)
                cells = [row.get(k) for k in keys]
                cells = [
                    "-" if v is None else (f"{v:.2f}" if "ratio" in k else f"{v:.3f}")
                    for k, v in zip(keys, cells, strict=True)
                ]
                print(markdown_row([kind, n, r, *cells]), flush=True)
    mem = []
    if not args.skip_memory:
        kind, n, r = args.mem_config.split(",")
        options = (args.mem_hidden, kind, int(n), int(r), args.vocab, args.mem_chunk)
        mem = [in_fresh_process(_memory, T, *options) for T in args.mem_T]
        print(
            f"\nchunked likelihood memory ({args.mem_config}, d={args.mem_hidden}, chunk={args.mem_chunk})"
        )
        print(markdown_header("T", "peak extra MiB", "of which hidden-sized (grad of hidden) MiB"))
        for m in mem:
            print(markdown_row([m["T"], f"{m['peak_extra_mb']:.1f}", f"{m['hidden_mb']:.1f}"]))
    write_json(args.json, {"rows": rows, "memory": mem}, indent=1)


if __name__ == "__main__":
    main()
