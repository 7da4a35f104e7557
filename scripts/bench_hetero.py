"""Heterogeneous-vocabulary speculative decoding on the tiny models, CPU, one run.

Target: the bundled tiny byte-level target (``assets/tiny_target``). Drafters, trained here
on the synthetic chat corpus rendered like the target's prompts (mtpc/evaluation/fixture_drafters.py):
a byte-level BPE Llama (``bpe``), the same with an NFKC + lowercase tokenizer (``lower``,
non-injective), and a smaller byte-level Llama (``byte_small``, same vocabulary: standard
SD). For every algorithm, greedy and sampling: tok/s, target tokens per target pass,
accepted drafts per pass, speed-up over AR of the same target on the same prompts.

Run from the repository root:
    python scripts/bench_hetero.py [--prompts 8] [--new 64] [--steps 300] [--out bench_hetero.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchlib import machine, markdown_header, markdown_row, timed  # noqa: E402

from mtpc.backbones.tiny import load_tiny_target  # noqa: E402
from mtpc.data.synthetic import generate_rows  # noqa: E402
from mtpc.evaluation.fixture_drafters import trained_models  # noqa: E402
from mtpc.evaluation.hetero import evaluate_hetero  # noqa: E402

RUNS = [  # (algorithm, drafter fixture, lookahead)
    ("slem", "bpe", 4),
    ("slem", "lower", 4),
    ("tli", "bpe", 4),
    ("union", "bpe", 4),
    ("slrs", "bpe", 4),
    ("standard", "byte_small", 6),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new target tokens per prompt")
    ap.add_argument("--steps", type=int, default=300, help="drafter training steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    train_s, built = timed(lambda: trained_models(steps=args.steps, num_rows=400, chat=True))
    tiny = load_tiny_target()
    target, codec = tiny.model, tiny.codec
    rows = generate_rows(args.prompts, seed=123)  # not the drafters' training rows (seed 0)
    prompts = [codec.generation_prompt(r["messages"][:1]) for r in rows]

    lines = []
    for greedy in (True, False):
        for algorithm, name, lookahead in RUNS:
            drafter = built["byte_small"] if name == "byte_small" else built[f"{name}_lm"]
            d_tok = built["codec"] if name == "byte_small" else built[name]
            out = evaluate_hetero(
                target, codec, drafter, d_tok, prompts, algorithm=algorithm,
                lookahead=lookahead, greedy=greedy, max_new_tokens=args.new, stop_ids=[],
            )  # fmt: skip
            ar, sd = out["rows"]
            ov = out["overlap"]
            mode = "greedy" if greedy else "sampling"
            line = markdown_row([
                mode, algorithm, name, lookahead, f"{ar['tok_s']:.1f}", f"{sd['tok_s']:.1f}",
                f"{sd['speedup_ar']:.2f}", f"{sd['mu_acc']:.2f}", f"{sd['mu_acc_drafts']:.2f}",
                f"{sd['drafter_passes_per_cycle']:.2f}", int(ov["vocab_intersection"]),
                f"{ov['vocab_intersection_over_target']:.2f}",
            ])  # fmt: skip
            print(line, flush=True)
            lines.append(line)
    header = markdown_header(
        "mode", "algorithm", "drafter", "lookahead", "AR tok/s", "tok/s", "x AR",
        "target tokens / pass", "accepted drafts / pass", "drafter passes / pass",
        "abs(T ∩ D)", "abs(T ∩ D) / abs(T)",
    )  # fmt: skip
    env = (
        f"{machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s), {args.prompts} prompts x {args.new} new tokens, "
        f"drafters trained {args.steps} steps ({train_s:.0f} s)"
    )
    table = f"{env}\n\n{header}\n" + "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
