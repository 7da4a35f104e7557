"""Decoding benchmark on the tiny target (CPU by default): AR vs self-speculative decoding.

One run measures, on the same prompts: AR tok/s (greedy and sampling), SD tok/s per family
and greedy draft mode (sample | map | chain) and for sampling, the speed-up over AR, and the
breakdown of a cycle (model = trunk + tails + STP head, head = MTPC head, circuit = drafting
and the circuit queries of verification, verify = target rule and acceptance logic, cache =
crops/commits, overhead = the rest of the Python loop).

Drafts: ``--draft DIR [DIR ...]`` (exported, e.g. by ``python train.py``), else one per
family built from the tiny target's pretrained MTP unembeddings (``head_init=pretrained``:
every family then equals FF, so the acceptance is FF's and only the latency differs).

    python scripts/bench_decoding.py                       # ~2 min on one CPU core
    python scripts/bench_decoding.py --draft outputs/train/<run>/draft --prompts 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpc.decoding import generate
from mtpc.evaluation.metrics import set_metrics


def _prompts(count: int, codec: str, max_len: int) -> list[list[int]]:
    from mtpc.data.datamodule import build_datamodule

    dm = build_datamodule(
        source="synthetic", codec=codec, num_rows=3000, seq_len=256, validation_fraction=0.05
    )
    sets = dm.prompt_sets(num_prompts=count, seeds=(0,), max_prompt_length=max_len)
    return [p.prompt_ids for p in sets[0]]


def _models(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel

    if args.draft:
        return [
            (
                Path(d).name if Path(d).name != "draft" else Path(d).parent.name,
                MTPCModel.from_pretrained(d),
            )
            for d in args.draft
        ]
    backbone = load_backbone("tiny", device=args.device)
    out = []
    for kind in args.families:
        rank = 1 if kind == "ff" else args.rank
        model = MTPCModel.from_backbone(backbone, kind, args.window, rank, lora_layers=0)
        out.append((f"{kind} n={args.window} r={rank} (pretrained MTP init)", model))
    return out


def _run(
    model: Any, prompts: list[list[int]], args: argparse.Namespace, **kw: Any
) -> dict[str, Any]:
    kw = {"max_new_tokens": args.new, "suppress_eos": True, **kw}
    generate(model, prompts[0], **kw)  # warm-up
    results = [generate(model, p, seed=i, **kw) for i, p in enumerate(prompts)]
    m = set_metrics(results, model.head.circuit.window)
    if kw.get("profile"):
        total: dict[str, float] = {}
        for r in results:
            for k, v in (r.breakdown or {}).items():
                total[k] = total.get(k, 0.0) + v
        cycle = sum(total.values())
        m["breakdown"] = {k: v / cycle for k, v in total.items()}
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", nargs="*", default=None)
    parser.add_argument("--families", nargs="*", default=["ff", "cp", "hmm", "btree"])
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models = _models(args)
    codec = models[0][1].backbone.codec
    context = getattr(models[0][1].backbone.config, "max_position_embeddings", 1024)
    prompts = _prompts(args.prompts, codec, int(context) - args.new - args.window - 1)
    first = models[0][1]
    ar = {
        "greedy": _run(first, prompts, args, method="autoregressive", greedy=True),
        "sampling": _run(first, prompts, args, method="autoregressive", greedy=False),
    }
    rows: list[dict[str, Any]] = []
    print(
        "| draft | mode | mu_lat ms | mu_acc | tok/s | x AR | model | head | circuit | verify | cache | overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, label in (("greedy", "AR greedy"), ("sampling", "AR sampling")):
        m = ar[name]
        print(
            f"| target | {label} | {m['mu_lat'] * 1e3:.3f} | 1.00 | {m['tok_s']:.1f} | 1.00 | | | | | | |"
        )
    for name, model in models:
        for mode, greedy in (("sample", True), ("map", True), ("chain", True), ("sample", False)):
            m = _run(model, prompts, args, greedy=greedy, draft_mode=mode, profile=True)
            ref = ar["greedy" if greedy else "sampling"]
            m["speedup_ar"] = m["tok_s"] / ref["tok_s"]
            b = m["breakdown"]
            label = f"{'greedy' if greedy else 'sampling'}/{mode}"
            print(
                f"| {name} | {label} | {m['mu_lat'] * 1e3:.3f} | {m['mu_acc']:.2f} | {m['tok_s']:.1f} "
                f"| {m['speedup_ar']:.2f} | "
                + " | ".join(
                    f"{100 * b[k]:.0f}%"
                    for k in ("model", "head", "circuit", "verify", "cache", "overhead")
                )
                + " |"
            )
            rows.append(
                {"draft": name, "mode": label, **{k: v for k, v in m.items() if k != "acceptance"}}
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"ar": ar, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
