"""Decoding benchmark on the tiny target (CPU by default): AR vs self-speculative decoding.

One run measures, on the same prompts: AR tok/s (greedy and sampling), SD tok/s per family
and draft mode (greedy: sample | map | chain | zmap | zsample; sampling: sample, the marginal
proposal, | zsample, the latent path's proposal, | zsample1, the marginal at the first draft
then the path's), the speed-up over AR, and the
breakdown of a cycle (model = trunk + tails + STP head, head = MTPC head, circuit = drafting
and the circuit queries of verification, verify = target rule and acceptance logic, cache =
crops/commits, overhead = the rest of the Python loop).

Drafts: ``--draft DIR [DIR ...]`` (exported, e.g. by ``python train.py``), else one per
family built from the tiny target's pretrained MTP unembeddings (``head_init=pretrained``:
every family then equals FF, so the acceptance is FF's and only the latency differs).

    python scripts/bench_decoding.py                       # ~2 min on one CPU core
    python scripts/bench_decoding.py --draft outputs/train/<run>/draft --prompts 8
    python scripts/bench_decoding.py --draft <ff> <btree> --modes greedy/zmap sampling/zsample --repeats 3

Every prompt is decoded by every (draft, mode) in turn (interleaved), so load drift on a
shared machine hits all of them alike; ``x FF cycle`` is each cycle over the first draft's
(pass the FF draft first) in the same mode, with ``--repeats`` > 1 followed by its range over
the repeats (each decodes every prompt once): how far this machine's noise moves it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from benchlib import markdown_header, markdown_row, write_json

from mtpc.decoding import CHAIN_RULES, generate
from mtpc.evaluation.metrics import set_metrics

MODES = (
    ("map", True),
    ("chain", True),
    ("zmap", True),
    ("sample", False),
    ("zsample", False),
    ("zsample1", False),
)
"""(draft rule, greedy): the full-table rules, then the latent-path ones (one leaf per draft).
Each runs as its drafting choice (``CHAIN_RULES``, docs/DECODING.md "Drafting")."""
CHOICES = {rule: {"draft": d, "proposal": p} for (d, p), rule in CHAIN_RULES.items()}


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


def _metrics(results: list[Any], window: int) -> dict[str, Any]:
    m = set_metrics(results, window)
    total: dict[str, float] = {}
    for r in results:
        for k, v in (r.breakdown or {}).items():
            total[k] = total.get(k, 0.0) + v
    cycle = sum(total.values())
    if cycle:
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
    parser.add_argument("--repeats", type=int, default=1, help="decode every prompt this often")
    parser.add_argument(
        "--modes", nargs="*", default=None, help="e.g. greedy/zmap sampling/zsample"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models = _models(args)
    codec = models[0][1].backbone.codec
    context = getattr(models[0][1].backbone.config, "max_position_embeddings", 1024)
    prompts = _prompts(args.prompts, codec, int(context) - args.new - args.window - 1)
    modes = [
        (m, g)
        for m, g in MODES
        if args.modes is None or f"{'greedy' if g else 'sampling'}/{m}" in args.modes
    ]
    # every (run, prompt) in turn, so that load drift on a shared machine hits all runs alike
    runs: list[tuple[str, Any, dict[str, Any]]] = [
        ("target", models[0][1], {"method": "autoregressive", "greedy": g}) for g in (True, False)
    ]
    runs += [
        (name, model, {"greedy": g, **CHOICES[m], "profile": True})
        for name, model in models
        for m, g in modes
    ]
    results: list[list[Any]] = [[] for _ in runs]
    common = {"max_new_tokens": args.new, "suppress_eos": True}
    for _, model, kw in runs:
        generate(model, prompts[0], **common, **kw)  # warm-up
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            for out, (_, model, kw) in zip(results, runs, strict=True):
                out.append(generate(model, p, seed=i, **common, **kw))
    window = models[0][1].head.circuit.window
    ar = {
        "greedy": _metrics(results[0], window),
        "sampling": _metrics(results[1], window),
    }
    parts = ("model", "head", "circuit", "verify", "cache", "overhead")
    print(markdown_header("draft", "mode", "mu_lat ms", "x FF cycle", "mu_acc", "tok/s", "x AR",
                          *parts))  # fmt: skip
    for name, label in (("greedy", "AR greedy"), ("sampling", "AR sampling")):
        m = ar[name]
        cells = ["target", label, f"{m['mu_lat'] * 1e3:.3f}", "", "1.00", f"{m['tok_s']:.1f}"]
        print(markdown_row([*cells, "1.00", *[""] * len(parts)]))
    rows: list[dict[str, Any]] = []
    # mode -> the first draft's cycle, overall and per repeat (FF when given first)
    first: dict[str, tuple[float, list[float]]] = {}
    count = len(prompts)
    for (name, _, kw), res in zip(runs[2:], results[2:], strict=True):
        m = _metrics(res, window)
        greedy = kw["greedy"]
        label = f"{'greedy' if greedy else 'sampling'}/{res[0].draft_rule}"
        m["speedup_ar"] = m["tok_s"] / ar["greedy" if greedy else "sampling"]["tok_s"]
        # per repeat (every prompt once): the spread is how far this machine's noise moves it
        cycles = [
            _metrics(res[k * count : (k + 1) * count], window)["mu_lat"]
            for k in range(args.repeats)
        ]
        ref, ref_cycles = first.setdefault(label, (m["mu_lat"], cycles))
        m["cycle_ratio"] = m["mu_lat"] / ref
        m["cycle_ratio_per_repeat"] = [c / f for c, f in zip(cycles, ref_cycles, strict=True)]
        spread = (
            f" ({min(m['cycle_ratio_per_repeat']):.2f}-{max(m['cycle_ratio_per_repeat']):.2f})"
            if args.repeats > 1
            else ""
        )
        print(markdown_row([
            name, label, f"{m['mu_lat'] * 1e3:.3f}", f"{m['cycle_ratio']:.2f}{spread}",
            f"{m['mu_acc']:.2f}", f"{m['tok_s']:.1f}", f"{m['speedup_ar']:.2f}",
            *(f"{100 * m['breakdown'][k]:.0f}%" for k in parts),
        ]))  # fmt: skip
        rows.append(
            {"draft": name, "mode": label, **{k: v for k, v in m.items() if k != "acceptance"}}
        )
    write_json(args.out, {"ar": ar, "rows": rows}, default=str)


if __name__ == "__main__":
    main()
