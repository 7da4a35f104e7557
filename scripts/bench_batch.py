"""Batched decoding benchmark on the tiny target (CPU by default): AR vs self-speculative
decoding of many prompts at batch sizes B.

For every B in ``--sizes`` one call ``mtpc.generate(model, prompts, batch_size=B)`` decodes
all prompts (B rows at once in one padded batch; a finished row's place goes to the next
prompt), autoregressively (``method="autoregressive"``, batched the same way) and
speculatively (greedy; ``--sampling`` adds T = 1 sampling). It reports:

* tokens/s: all rows' new tokens over the wall time of the whole call, prefills included;
* SD/AR: the speed-up of speculative over autoregressive decoding at the same B;
* x B=1: each method's tokens/s over its own at the smallest size (B = 1 when given);
* tok/cyc: accepted tokens per cycle of a row (``sum(emitted) / len(emitted)``), the mean
  over rows, and pooled (all rows' tokens over all rows' cycles). Greedy, it should not
  depend on B: the output is the target's at every B (``!= B=1``: rows whose tokens differ
  from the smallest size's, which should be 0 in float64 and rare in float32);
* the share of a speculative cycle spent per section (``profile=True``: model = the one
  batched trunk + tail pass and the head, circuit = drafting, verify = the acceptance tests,
  cache = crops/commits, overhead = the rest of the loop; the greedy draft and every chain's
  acceptance run for all rows at once, sampled drafts' circuit calls row by row), and the
  acceptance's time per row and cycle (``verify us/row-cyc``: the verify section over all
  rows' cycles);
* ``--what regenerate``: rows/s of regeneration (``regenerate_rows``, as
  ``scripts/regenerate.py batch_size=B`` runs it: greedy, speculative with the draft) of
  ``--prompts`` synthetic rows at each B, and the rows that differ from B = 1's.

Drafts: ``--draft DIR`` (exported, e.g. by ``python train.py``), else a BTree (n = 8, r = 8)
built from the tiny target's pretrained MTP unembeddings (``head_init=pretrained``: it then
equals FF, so its acceptance is FF's, and nothing is trained).

    python scripts/bench_batch.py                                     # pretrained-init BTree
    python scripts/bench_batch.py --draft outputs/train/<run>/draft --sizes 1 4 16 64 --sampling --repeats 3
    python scripts/bench_batch.py --evabyte-code <dir> --eva window_size=16 --sizes 1 4 16  # EvaByte

Every (B, method) runs in turn within a repeat (the order rotating between repeats), so load
drift on a shared machine hits all of them alike; a cell's wall time is the median over the
repeats (the minimum is in the JSON).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from benchlib import machine, markdown_header, markdown_row, timed, write_json

PARTS = ("model", "head", "circuit", "verify", "cache", "overhead")
"""Sections of a speculative cycle (``GenerationResult.breakdown``)."""


def _prompts(count: int, codec: str, max_len: int) -> list[list[int]]:
    """``count`` chat prompts of the synthetic data (ragged lengths), as bench_decoding's."""
    from mtpc.data.datamodule import build_datamodule

    dm = build_datamodule(
        source="synthetic", codec=codec, num_rows=3000, seq_len=256, validation_fraction=0.05
    )
    sets = dm.prompt_sets(num_prompts=count, seeds=(0,), max_prompt_length=max_len)
    return [p.prompt_ids for p in sets[0]]


def _model(args: argparse.Namespace) -> tuple[str, Any]:
    """The draft to measure and its label."""
    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel

    if args.evabyte_code:
        return _evabyte_model(args)
    if args.draft:
        path = Path(args.draft)
        name = path.name if path.name != "draft" else path.parent.name
        model = MTPCModel.from_pretrained(args.draft, device=args.device)
        if args.dtype:  # the target in another dtype (its identity is checked in its own)
            model.backbone.hf_model.to(getattr(torch, args.dtype))
        return name, model
    backbone = load_backbone(
        "tiny", device=args.device, **({"dtype": args.dtype} if args.dtype else {})
    )
    model = MTPCModel.from_backbone(backbone, "btree", args.window, args.rank, lora_layers=0)
    return (
        f"btree n={args.window} r={args.rank} (pretrained MTP init: its acceptance is FF's)",
        model,
    )


def _evabyte_model(args: argparse.Namespace) -> tuple[str, Any]:
    """``--evabyte-code``: a tiny random checkpoint of EvaByte's real remote code
    (``scripts/check_remote_code.py``'s, ``--eva`` fields on top, float32, the torch EVA path
    on a CPU) and a BTree of its pretrained MTP unembeddings (n = ``--window``, r = ``--rank``)."""
    import importlib.util
    import tempfile

    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel

    spec = importlib.util.spec_from_file_location(
        "mtpc_check_remote_code", Path(__file__).with_name("check_remote_code.py")
    )
    assert spec is not None and spec.loader is not None
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    code = Path(args.evabyte_code)
    code = code / "evabyte_hf" if (code / "evabyte_hf").is_dir() else code
    fields = {"max_position_embeddings": 512}
    for item in args.eva:
        key, _, value = item.partition("=")
        fields[key] = int(value)
    root = Path(tempfile.mkdtemp(prefix="bench_batch_evabyte_"))
    folder, _ = tools.write_checkpoint("evabyte", code, "default", root, **fields)
    impl = "auto" if args.device.startswith("cuda") else "torch"
    backbone = load_backbone(
        "evabyte", path=str(folder), dtype="float32", device=args.device, attention_impl=impl
    )
    model = MTPCModel.from_backbone(backbone, "btree", args.window, args.rank, lora_layers=0)
    config = backbone.config
    shown = ", ".join(f"{k}={getattr(config, k)}" for k in EVA_SHOWN)
    return (
        f"tiny EvaByte ({shown}), btree n={args.window} r={args.rank} (pretrained MTP init)",
        model,
    )


EVA_SHOWN = ("hidden_size", "num_hidden_layers", "window_size", "chunk_size")
"""The tiny EvaByte's config fields named in the report."""


def _per_row_tokens_per_cycle(results: Sequence[Any]) -> tuple[float, float]:
    """Accepted tokens per cycle: the mean over rows of each row's, and the pooled one."""
    per_row = [sum(r.emitted) / max(1, len(r.emitted)) for r in results]
    pooled = sum(sum(r.emitted) for r in results) / max(1, sum(len(r.emitted) for r in results))
    return statistics.fmean(per_row), pooled


def _breakdowns(results: Sequence[Any], size: int) -> list[dict[str, float] | None]:
    """The runs' section times: at B > 1 one run decodes every row and each result carries
    the run's breakdown; at B = 1 each prompt is its own run."""
    return [results[0].breakdown] if size > 1 else [r.breakdown for r in results]


def _shares(results: Sequence[Any], size: int) -> dict[str, float]:
    """Fraction of the cycles' time per section (the runs' summed)."""
    total: dict[str, float] = {}
    for part in _breakdowns(results, size):
        for key, value in (part or {}).items():
            total[key] = total.get(key, 0.0) + value
    cycle = sum(total.values())
    return {k: v / cycle for k, v in total.items()} if cycle else {}


def _verify_per_row_cycle(results: Sequence[Any], size: int) -> float:
    """Microseconds of the acceptance section (``verify``) per row and cycle."""
    seconds = sum((part or {}).get("verify", 0.0) for part in _breakdowns(results, size))
    return 1e6 * seconds / max(1, sum(len(r.cycle_seconds) for r in results))


def measure_decoding(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per (mode, B): AR and SD tokens/s, the speed-ups and tokens per cycle."""
    from mtpc.decoding import generate

    modes = ["greedy"] + (["sampling"] if args.sampling else [])
    methods = ("autoregressive", "speculative")
    cells = [(m, b, how) for m in modes for b in args.sizes for how in methods]
    common = {"max_new_tokens": args.max_new_tokens, "suppress_eos": args.suppress_eos}
    seeds = list(range(len(prompts)))

    def call(mode: str, size: int, how: str, batch: list[list[int]], **kw: Any) -> list[Any]:
        return generate(model, batch, method=how, greedy=mode == "greedy", seed=seeds[: len(batch)],
                        batch_size=size, profile=True, **{**common, **kw})  # fmt: skip

    for mode, size, how in cells:  # warm-up: a few new tokens of one batch each
        call(mode, size, how, prompts[:size], max_new_tokens=min(4, args.max_new_tokens))
    walls: dict[tuple[str, int, str], list[float]] = {cell: [] for cell in cells}
    outputs: dict[tuple[str, int, str], list[Any]] = {}
    for k in range(args.repeats):
        shift = k % len(cells)  # rotate the order, so no cell always runs first or last
        for cell in cells[shift:] + cells[:shift]:
            seconds, results = timed(lambda cell=cell: call(*cell, prompts))
            walls[cell].append(seconds)
            outputs[cell] = results  # greedy: the same every repeat; sampling: seeded
    first = args.sizes[0]
    rows: list[dict[str, Any]] = []
    for mode in modes:
        speed: dict[tuple[int, str], float] = {}
        for size in args.sizes:
            row: dict[str, Any] = {"mode": mode, "batch_size": size}
            for how in methods:
                results = outputs[(mode, size, how)]
                tokens = sum(len(r.tokens) for r in results)
                wall = statistics.median(walls[(mode, size, how)])
                speed[(size, how)] = tokens / wall
                short = "ar" if how == "autoregressive" else "sd"
                row[f"{short}_tok_s"] = tokens / wall
                row[f"{short}_seconds"] = walls[(mode, size, how)]
                row[f"{short}_tok_s_best"] = tokens / min(walls[(mode, size, how)])
                row[f"{short}_x_first"] = speed[(size, how)] / speed[(first, how)]
                row[f"{short}_differ_first"] = sum(
                    r.tokens != f.tokens
                    for r, f in zip(results, outputs[(mode, first, how)], strict=True)
                )
                row["new_tokens"] = tokens
            sd = outputs[(mode, size, "speculative")]
            row["sd_x_ar"] = speed[(size, "speculative")] / speed[(size, "autoregressive")]
            row["tok_per_cycle"], row["tok_per_cycle_pooled"] = _per_row_tokens_per_cycle(sd)
            row["sd_differ_ar"] = sum(
                s.tokens != a.tokens
                for s, a in zip(sd, outputs[(mode, size, "autoregressive")], strict=True)
            )
            row["sd_shares"] = _shares(sd, size)
            row["sd_verify_us_per_row_cycle"] = _verify_per_row_cycle(sd, size)
            rows.append(row)
    return rows


def table_decoding(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of :func:`measure_decoding`'s rows."""
    first = rows[0]["batch_size"]
    columns = ["mode", "B", "AR tok/s", "SD tok/s", "SD/AR", f"AR x B={first}", f"SD x B={first}",
               "tok/cyc (rows)", "tok/cyc (pooled)", f"!= B={first} (AR, SD)", "SD != AR",
               *(f"SD {p}" for p in PARTS), "SD verify us/row-cyc"]  # fmt: skip
    lines = [markdown_header(*columns)]
    for r in rows:
        shares = r["sd_shares"]
        lines.append(markdown_row([
            r["mode"], r["batch_size"], f"{r['ar_tok_s']:.0f}", f"{r['sd_tok_s']:.0f}",
            f"{r['sd_x_ar']:.2f}", f"{r['ar_x_first']:.2f}", f"{r['sd_x_first']:.2f}",
            f"{r['tok_per_cycle']:.3f}", f"{r['tok_per_cycle_pooled']:.3f}",
            f"{r['ar_differ_first']}, {r['sd_differ_first']}",
            r["sd_differ_ar"] if r["mode"] == "greedy" else "",
            *(f"{100 * shares[p]:.0f}%" if p in shares else "" for p in PARTS),
            f"{r['sd_verify_us_per_row_cycle']:.0f}",
        ]))  # fmt: skip
    return "\n".join(lines)


def measure_regeneration(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per B: rows/s of regeneration (``regenerate_rows``: every assistant turn of
    ``--prompts`` synthetic rows rewritten by the target, greedy, speculative with the draft,
    ``batch_size=B``), its new tokens/s, and whether the rows equal B = 1's."""
    from mtpc.backbones.codecs import get_codec
    from mtpc.data.sources import load_source
    from mtpc.decoding.common import context_length
    from mtpc.regeneration import Settings, regenerate_rows

    source = load_source("synthetic", None, num_rows=args.prompts, seed=0)
    rows = list(enumerate(source))
    codec, context = get_codec(model.backbone.codec), context_length(model)
    settings = Settings(method="speculative", max_new_tokens=args.max_new_tokens)
    for size in args.sizes:  # warm-up
        regenerate_rows(model, codec, rows[:size], settings, context, size)
    walls: dict[int, list[float]] = {size: [] for size in args.sizes}
    outputs: dict[int, list[Any]] = {}
    for k in range(args.repeats):
        shift = k % len(args.sizes)
        for size in args.sizes[shift:] + args.sizes[:shift]:
            seconds, outputs[size] = timed(
                lambda size=size: regenerate_rows(model, codec, rows, settings, context, size)
            )
            walls[size].append(seconds)
    first = args.sizes[0]
    out = []
    for size in args.sizes:
        wall = statistics.median(walls[size])
        tokens = sum(sum(r.row["regenerated"]["new_tokens"]) for r in outputs[size] if r.row)
        out.append({
            "batch_size": size, "rows": len(rows), "seconds": walls[size],
            "rows_s": len(rows) / wall, "tok_s": tokens / wall,
            "x_first": statistics.median(walls[first]) / wall,
            "differ_first": sum(a != b for a, b in zip(outputs[size], outputs[first], strict=True)),
        })  # fmt: skip
    return out


def table_regeneration(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of :func:`measure_regeneration`'s rows."""
    first = rows[0]["batch_size"]
    lines = [markdown_header("B", "rows", "rows/s", "new tok/s", f"x B={first}",
                             f"rows != B={first}")]  # fmt: skip
    for r in rows:
        lines.append(markdown_row([
            r["batch_size"], r["rows"], f"{r['rows_s']:.2f}", f"{r['tok_s']:.0f}",
            f"{r['x_first']:.2f}", r["differ_first"],
        ]))  # fmt: skip
    return "\n".join(lines)


WHAT: dict[str, tuple[Callable[..., list[dict[str, Any]]], Callable[..., str]]] = {
    "decode": (measure_decoding, table_decoding),
    "regenerate": (measure_regeneration, table_regeneration),
}
"""``--what``: what is measured at each B (its rows) and how its table is printed."""


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--what", nargs="*", default=["decode"], choices=sorted(WHAT))
    parser.add_argument("--draft", default=None, help="an exported draft folder")
    parser.add_argument(
        "--evabyte-code", default=None,
        help="a dir with EvaByte's remote code (evabyte_hf/*.py): a tiny EvaByte of it instead",
    )  # fmt: skip
    parser.add_argument(
        "--eva", nargs="*", default=[],
        help="the tiny EvaByte's config fields, e.g. window_size=16 hidden_size=64",
    )  # fmt: skip
    parser.add_argument("--window", type=int, default=8, help="the default draft's n")
    parser.add_argument("--rank", type=int, default=8, help="the default draft's r")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--sampling", action="store_true", help="add T = 1 sampling")
    parser.add_argument(
        "--suppress-eos", action=argparse.BooleanOptionalAction, default=True,
        help="fixed-length rows (default); --no-suppress-eos: rows end at their end of turn",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="decode every cell this often")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: the draft's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not args.sizes or min(args.sizes) < 1 or args.prompts < 1 or args.repeats < 1:
        parser.error("--sizes, --prompts and --repeats: allowed: ints >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints its tables and returns (and with ``--json`` writes) them."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    name, model = _model(args)
    context = getattr(model.backbone.config, "max_position_embeddings", 1024)
    window = model.head.circuit.window
    prompts = _prompts(
        args.prompts, model.backbone.codec, int(context) - args.max_new_tokens - window - 1
    )
    lengths = [len(p) for p in prompts]
    print(f"machine: {machine()}, {args.threads} thread(s), {args.device}; draft: {name}")
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} ids, "
          f"{args.max_new_tokens} new tokens each, {args.repeats} repeat(s), median wall time")  # fmt: skip
    report: dict[str, Any] = {"machine": machine(), "draft": name, "args": vars(args)}
    for what in args.what:
        measure, table = WHAT[what]
        rows = measure(model, prompts, args)
        print(table(rows))
        report[what] = rows
    write_json(args.json, report, default=str)
    return report


if __name__ == "__main__":
    main()
