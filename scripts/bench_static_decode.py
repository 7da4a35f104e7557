"""Compiled decoding benchmark on the tiny target (CPU by default): autoregressive decoding
with the eager layouts vs the static, compiled decode step (``mtpc.generate(...,
compile=...)``, docs/DECODING.md "Compiled decoding").

For every B in ``--sizes`` it reports:

* tokens/s of ``mtpc.generate(model, prompts, method="autoregressive", batch_size=B)``,
  eager and compiled (all rows' new tokens over the whole call's wall time, prefills
  included; fixed-length rows: the stop ids are suppressed), and whether the tokens are equal;
* one decode step alone (one new id per row, the layout's ``target``: the loop's model call),
  eager (``Stream`` at B = 1, ``Padded`` above) and compiled (``StaticLayout``): median ms
  over ``--steps`` steps, and the aten ops it dispatches. Eager: counted by a
  ``TorchDispatchMode`` (every op that reaches the dispatcher's Python key). Dynamo refuses
  to run a compiled frame under a dispatch mode, so both are also counted by the profiler:
  the outermost ``aten::`` calls of the step (a compiled CPU graph's fused C++ kernels are
  not aten calls; its matmuls and the step's host-side set-up are).

The speculative chain (``--chain``, a draft on the tiny target: BTree n = ``--window``,
r = ``--rank`` from the target's MTP unembeddings, a LoRA tail of ``--lora`` layers; greedy,
``policy=condition``), eager vs compiled, for every B:

* tokens/s of ``mtpc.generate(model, prompts, batch_size=B)`` (as above), tokens per cycle,
  whether the rows equal;
* aten calls per cycle: the outermost ``aten::`` calls the profiler records in one whole
  call (prefills, draft steps and acceptance included: those stay eager), over its cycles;
* one cycle's model work alone (the layout's verify pass of a window per row, the keep of
  half of it and the draft tail over the kept states; the calls' capacity, as many cycles as
  ``--max-new-tokens`` allows, at most ``--steps``): median ms and aten calls.

A token tree's cycle (``--tree-budget N``, ``--tree-only``: without the AR rows): the same
draft, a pass of a pending root and N nodes per row (a binary heap; its depths and ancestor
mask), the keep of its rightmost path (compacted: the nodes move to the pass's first slots),
the draft tail over the kept states; eager vs compiled, median ms and aten calls.

The compiled graphs are built first (``warm-up`` column: seconds of the first call, which
compiles the step at this B and the prefill chunk; the chain's: its verify and draft-tail
steps too) and are not timed. Cells alternate between repeats; a cell's wall time is the
median over the repeats.

    python scripts/bench_static_decode.py                               # inductor, B = 1, 8
    python scripts/bench_static_decode.py --backend aot_eager --sizes 1 4 16 --repeats 5
    python scripts/bench_static_decode.py --chain --sizes 1 8           # + the speculative chain
    python scripts/bench_static_decode.py --tree-budget 16 --tree-only --backend aot_eager
    python scripts/bench_static_decode.py --target evabyte --evabyte-code DIR --chain --window 4

``--target evabyte`` (``--evabyte-code DIR``, a folder with EvaByte's ``evabyte_hf/*.py``,
default ``$MTPC_EVABYTE_CODE``) measures a tiny random
checkpoint of EvaByte's real remote code instead (``scripts/bench_batch.py``'s: EVA window
16, chunks of 4, float32, the torch EVA path): its eager path is ``Stream`` at B = 1 and
``static_eva.EvaStaticEngine`` uncompiled above, its compiled one the same engine compiled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from bench_batch import _evabyte_model, _prompts
from benchlib import machine, markdown_header, markdown_row, timed, write_json
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside the block (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def profiled_ops(fn: Callable[[], object]) -> int:
    """The outermost ``aten::`` calls (no ``aten::`` caller) the profiler records in ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def aten(event: Any) -> bool:
        return event is not None and str(event.name).startswith("aten::")

    return sum(aten(e) and not aten(e.cpu_parent) for e in prof.events())


def eager_layout(model: Any, size: int, capacity: int, widest: int = 0) -> Any:
    """The eager path's layout of ``size`` rows (as ``mtpc.generate`` picks it: EvaByte's
    batches on its engine of ``capacity`` slots, uncompiled)."""
    from mtpc.decoding.layout import Padded, Stream
    from mtpc.decoding.static import StaticEngine, StaticLayout, engine_class, engine_for

    if size == 1:
        return Stream(model)
    if engine_class(model) is StaticEngine:
        return Padded(model)
    return StaticLayout(engine_for(model, size, capacity, None, widest), widest)


def step_cost(
    layout: Any, rows: Sequence[Any], steps: int, device: torch.device, dispatch: bool
) -> dict[str, float]:
    """Median ms of a decode step (one id per row through ``layout.target``) over ``steps``
    steps, the outermost aten calls the profiler sees in one and (``dispatch``) the aten ops
    a ``TorchDispatchMode`` sees."""
    ids = [torch.tensor([65], device=device) for _ in rows]
    trees = [None] * len(rows)
    layout.target(rows, ids, trees)  # warm (caches, allocator)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        layout.target(rows, ids, trees)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    out = {
        "step_ms": 1000 * statistics.median(times),
        "step_aten_calls": profiled_ops(lambda: layout.target(rows, ids, trees)),
    }
    if dispatch:
        with OpCounter() as counter:
            layout.target(rows, ids, trees)
        out["step_dispatched_ops"] = sum(counter.ops.values())
    return out


@torch.no_grad()
def measure_steps(model: Any, prompts: list[list[int]], size: int, args: argparse.Namespace):
    """The decode step alone, eager and compiled, with ``size`` rows held."""
    from mtpc.decoding.static import StaticLayout, capacity_for, engine_for

    device = model.backbone.device
    batch = [torch.tensor(p, device=device) for p in (prompts * size)[:size]]
    rows = [object() for _ in batch]
    longest = max(len(p) for p in batch) + args.steps + 2
    eager = eager_layout(model, size, capacity_for(longest))
    eager.admit(rows, batch)
    engine = engine_for(model, size, capacity_for(longest), args.backend)
    compiled = StaticLayout(engine)
    compiled.admit(rows, batch)
    out: dict[str, Any] = {}
    for name, layout in (("eager", eager), ("compiled", compiled)):
        cost = step_cost(layout, rows, args.steps, device, dispatch=name == "eager")
        out.update({f"{name}_{key}": value for key, value in cost.items()})
    out["step_engine"] = engine.engine
    return out


Cell = tuple[int, Any]  # (B, compile)


def timed_cells(
    call: Callable[..., list[Any]], args: argparse.Namespace, warm_tokens: int
) -> tuple[dict[Cell, list[float]], dict[Cell, list[Any]], dict[int, float]]:
    """Every (B, eager or compiled) cell's wall times over the repeats (cells alternating),
    its last outputs, and each B's warm-up seconds (the compiled call of ``warm_tokens``
    tokens that builds its graphs; an eager one warms the eager path)."""
    warm = {}
    for size in args.sizes:
        warm[size] = timed(lambda size=size: call(size, args.backend, warm_tokens))[0]
        call(size, False, 2)
    cells = [(size, how) for size in args.sizes for how in (False, args.backend)]
    walls: dict[Cell, list[float]] = {cell: [] for cell in cells}
    outputs: dict[Cell, list[Any]] = {}
    for k in range(args.repeats):
        shift = k % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            seconds, outputs[cell] = timed(lambda cell=cell: call(*cell))
            walls[cell].append(seconds)
    return walls, outputs, warm


def measure(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """One row per B: the calls' tokens/s eager and compiled, and the step alone."""
    from mtpc.decoding import generate

    seeds = list(range(len(prompts)))

    def call(size: int, compile: bool | str, new: int = args.max_new_tokens) -> list[Any]:
        return generate(model, prompts, new, method="autoregressive", seed=seeds,
                        batch_size=size, suppress_eos=True, compile=compile)  # fmt: skip

    walls, outputs, warm = timed_cells(call, args, 2)  # warm-up: decode step, prefill chunk
    rows = []
    for size in args.sizes:
        eager, compiled = outputs[(size, False)], outputs[(size, args.backend)]
        tokens = sum(len(r.tokens) for r in eager)
        row: dict[str, Any] = {"batch_size": size, "new_tokens": tokens, "warmup_s": warm[size]}
        for name, how in (("eager", False), ("compiled", args.backend)):
            row[f"{name}_seconds"] = walls[(size, how)]
            row[f"{name}_tok_s"] = tokens / statistics.median(walls[(size, how)])
        row["x_eager"] = row["compiled_tok_s"] / row["eager_tok_s"]
        row["differ"] = sum(a.tokens != b.tokens for a, b in zip(eager, compiled, strict=True))
        row["engines"] = sorted({r.engine for r in compiled})
        row.update(measure_steps(model, prompts, size, args))
        rows.append(row)
    return rows


def cycle_cost(
    layout: Any, rows: Sequence[Any], steps: int, device: torch.device, window: int,
    keep: int | torch.Tensor, tree: Any = None,
) -> dict[str, float]:  # fmt: skip
    """Median ms of one cycle's model work (a verify pass of ``window`` ids per row, a keep of
    ``keep`` of them: a prefix's length, or a tree's kept nodes ``(K,)``; the draft tail
    over the kept states) over ``steps`` cycles, and the outermost aten calls the profiler
    sees in one. ``tree``: the pass's ``(depth (T,), mask (T, T))`` (None: a chain)."""
    ids = [torch.arange(65, 65 + window, device=device) for _ in rows]
    trees = [tree] * len(rows)

    def one() -> None:
        states = layout.target(rows, ids, trees)[0]
        layout.keep(rows, [keep] * len(rows))
        layout.draft(rows, [s[:, :keep] if isinstance(keep, int) else s[:, keep] for s in states])

    one()  # warm (caches, allocator)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        one()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"cycle_ms": 1000 * statistics.median(times), "cycle_aten_calls": profiled_ops(one)}


def heap_tree(nodes: int, depth: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """A pending root and ``nodes - 1`` nodes as a binary heap (node i's parent: (i - 1) // 2):
    its ``(depth (T,), ancestor mask (T, T))`` and the kept path ``(K,)``, the rightmost
    one down to ``depth`` (its nodes off the pass's prefix: the keep moves them)."""
    parents = [(i - 1) // 2 for i in range(nodes)]
    mask = torch.eye(nodes, dtype=torch.bool, device=device)
    for i in range(1, nodes):
        mask[i] |= mask[parents[i]]
    depths = torch.tensor([(i + 1).bit_length() - 1 for i in range(nodes)], device=device)
    path = [0]
    while 2 * path[-1] + 2 < nodes and len(path) <= depth:
        path.append(2 * path[-1] + 2)
    return (depths, mask), torch.tensor(path, device=device)


@torch.no_grad()
def measure_cycles(
    model: Any, prompts: list[list[int]], size: int, args: argparse.Namespace, budget: int = 0
) -> dict[str, Any]:
    """One cycle's model work alone, eager and compiled, with ``size`` rows held: a chain's
    (``budget`` 0), or a token tree's of ``budget`` nodes and a pending root."""
    from mtpc.decoding.static import (
        StaticEngine,
        StaticLayout,
        capacity_for,
        engine_class,
        engine_for,
    )

    device, window = model.backbone.device, model.head.circuit.window
    batch = [torch.tensor(p, device=device) for p in (prompts * size)[:size]]
    rows = [object() for _ in batch]
    # the calls' capacity (the same compiled graphs); as many cycles as their tokens allow
    width = budget + 1 if budget else window
    longest = max(len(p) for p in batch) + args.max_new_tokens + max(window + 1, width)
    widest = budget + 1 if budget else 0
    eager = eager_layout(model, size, capacity_for(longest), widest)
    engine = engine_for(model, size, capacity_for(longest), args.backend, widest)
    compiled = StaticLayout(engine, widest)
    tree, keep = None, max(1, window // 2)
    # half of the pass kept; EvaByte keeps it whole (all accepted): half of a pass that crossed
    # a window's end would cut into the compressed window (the loop's drafts never cross it)
    if engine_class(model) is not StaticEngine:  # EvaByte
        keep = window
    if budget:  # the root and the heap's rightmost path, at most the window
        tree, keep = heap_tree(width, window - 1, device)
    kept = keep if isinstance(keep, int) else keep.shape[0]
    steps = max(1, min(args.steps, args.max_new_tokens // kept - 2))
    out: dict[str, Any] = {"cycle_steps": steps, "cycle_keep": kept}
    for name, layout in (("eager", eager), ("compiled", compiled)):
        layout.draft(rows, layout.admit(rows, batch)[0])
        cost = cycle_cost(layout, rows, steps, device, width, keep, tree)
        out.update({f"{name}_{key}": value for key, value in cost.items()})
    out["cycle_engine"] = engine.engine
    return out


def tree_table(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """One row per B: a token tree cycle's model work alone (``--tree-budget`` nodes), eager
    vs compiled, printed as a Markdown table."""
    rows = [{"batch_size": size, **measure_cycles(model, prompts, size, args, args.tree_budget)}
            for size in args.sizes]  # fmt: skip
    lines = [markdown_header("B", "nodes", "kept", "cycle model ms eager",
                             "cycle model ms compiled", "x eager", "cycle model aten eager",
                             "cycle model aten compiled", "engine")]  # fmt: skip
    for r in rows:
        lines.append(markdown_row([
            r["batch_size"], args.tree_budget, r["cycle_keep"], f"{r['eager_cycle_ms']:.2f}",
            f"{r['compiled_cycle_ms']:.2f}", f"{r['eager_cycle_ms'] / r['compiled_cycle_ms']:.2f}",
            r["eager_cycle_aten_calls"], r["compiled_cycle_aten_calls"], r["cycle_engine"],
        ]))  # fmt: skip
    print("\n".join(lines))
    return rows


def measure_chain(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """One row per B: the speculative chain's tokens/s eager and compiled, tokens per cycle,
    aten calls per cycle (whole calls) and one cycle's model work alone."""
    from mtpc.decoding import generate

    def call(size: int, compile: bool | str, new: int = args.max_new_tokens) -> list[Any]:
        return generate(model, prompts, new, batch_size=size, suppress_eos=True,
                        compile=compile)  # fmt: skip

    # the warm-up compiles the prefill chunk, the verify step and the draft tail's steps
    walls, outputs, warm = timed_cells(call, args, 2 * args.window)
    rows = []
    for size in args.sizes:
        eager, compiled = outputs[(size, False)], outputs[(size, args.backend)]
        tokens = sum(len(r.tokens) for r in eager)
        cycles = sum(len(r.accepted) for r in eager)
        row: dict[str, Any] = {"batch_size": size, "new_tokens": tokens, "cycles": cycles,
                               "tokens_per_cycle": tokens / cycles, "warmup_s": warm[size]}  # fmt: skip
        for name, how in (("eager", False), ("compiled", args.backend)):
            row[f"{name}_seconds"] = walls[(size, how)]
            row[f"{name}_tok_s"] = tokens / statistics.median(walls[(size, how)])
            ops = profiled_ops(lambda size=size, how=how: call(size, how))
            row[f"{name}_aten_calls_per_cycle"] = ops / cycles
        row["x_eager"] = row["compiled_tok_s"] / row["eager_tok_s"]
        row["differ"] = sum(
            (a.tokens, a.accepted) != (b.tokens, b.accepted)
            for a, b in zip(eager, compiled, strict=True)
        )
        row["engines"] = sorted({r.engine for r in compiled})
        row.update(measure_cycles(model, prompts, size, args))
        rows.append(row)
    return rows


def chain_table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of :func:`measure_chain`'s rows."""
    lines = [markdown_header("B", "tok/cycle", "eager tok/s", "compiled tok/s", "x eager",
                             "rows differ", "aten calls/cycle eager", "aten calls/cycle compiled",
                             "cycle model ms eager", "cycle model ms compiled",
                             "cycle model aten eager", "cycle model aten compiled", "warm-up s",
                             "engine")]  # fmt: skip
    for r in rows:
        lines.append(markdown_row([
            r["batch_size"], f"{r['tokens_per_cycle']:.2f}", f"{r['eager_tok_s']:.0f}",
            f"{r['compiled_tok_s']:.0f}", f"{r['x_eager']:.2f}", r["differ"],
            f"{r['eager_aten_calls_per_cycle']:.0f}", f"{r['compiled_aten_calls_per_cycle']:.0f}",
            f"{r['eager_cycle_ms']:.2f}", f"{r['compiled_cycle_ms']:.2f}",
            r["eager_cycle_aten_calls"], r["compiled_cycle_aten_calls"], f"{r['warmup_s']:.1f}",
            "+".join(r["engines"]),
        ]))  # fmt: skip
    return "\n".join(lines)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of :func:`measure`'s rows."""
    lines = [markdown_header("B", "eager tok/s", "compiled tok/s", "x eager", "rows differ",
                             "step ms eager", "step ms compiled", "aten ops/step eager (mode)",
                             "aten calls/step eager", "aten calls/step compiled", "warm-up s",
                             "engine")]  # fmt: skip
    for r in rows:
        lines.append(markdown_row([
            r["batch_size"], f"{r['eager_tok_s']:.0f}", f"{r['compiled_tok_s']:.0f}",
            f"{r['x_eager']:.2f}", r["differ"], f"{r['eager_step_ms']:.2f}",
            f"{r['compiled_step_ms']:.2f}", r["eager_step_dispatched_ops"],
            r["eager_step_aten_calls"], r["compiled_step_aten_calls"], f"{r['warmup_s']:.1f}",
            "+".join(sorted({*r["engines"], r["step_engine"]})),
        ]))  # fmt: skip
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed alone")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--chain", action="store_true", help="also the speculative chain")
    parser.add_argument("--chain-only", action="store_true", help="the chain, no AR rows")
    parser.add_argument("--window", type=int, default=8, help="the chain's draft: n")
    parser.add_argument("--rank", type=int, default=8, help="the chain's draft: r")
    parser.add_argument("--lora", type=int, default=1, help="the chain's draft: k")
    parser.add_argument(
        "--tree-budget",
        type=int,
        default=0,
        help="also a token tree's cycle of this many nodes (its model work)",
    )
    parser.add_argument("--tree-only", action="store_true", help="the tree cycle, no AR rows")  # fmt: skip
    parser.add_argument("--evabyte-code", default=os.environ.get("MTPC_EVABYTE_CODE") or None,
                        help="measure a tiny EvaByte of the real remote code in this folder "
                        "(default $MTPC_EVABYTE_CODE)")  # fmt: skip
    parser.add_argument("--target", default="tiny", choices=["tiny", "evabyte"])
    args = parser.parse_args(argv)
    if args.tree_budget and args.target == "evabyte":
        parser.error("--tree-budget: EvaByte's engine runs chains; allowed: --target tiny")
    if not args.sizes or min(args.sizes) < 1 or min(args.prompts, args.repeats, args.steps) < 1:
        parser.error("--sizes, --prompts, --steps and --repeats: allowed: ints >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints its table and JSON and returns (with ``--json`` writes) it."""
    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel

    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.target == "evabyte":
        if not args.evabyte_code:
            raise SystemExit("--target evabyte needs --evabyte-code DIR (or $MTPC_EVABYTE_CODE)")
        options = argparse.Namespace(
            evabyte_code=args.evabyte_code, eva=[], device=args.device, window=args.window,
            rank=args.rank,
        )  # fmt: skip
        label, eva = _evabyte_model(options)
        print(label)
        model = MTPCModel.target_only(eva.backbone)
    else:
        model = MTPCModel.target_only(load_backbone("tiny", device=args.device))
    context = int(model.backbone.config.max_position_embeddings)
    prompts = _prompts(args.prompts, model.backbone.codec, context - args.max_new_tokens - 1)
    lengths = [len(p) for p in prompts]
    print(f"machine: {machine()}, {args.threads} thread(s), {args.device}, torch "
          f"{torch.__version__}; backend {args.backend}; {len(prompts)} prompts of "
          f"{min(lengths)}-{max(lengths)} ids, {args.max_new_tokens} new tokens each, "
          f"{args.repeats} repeat(s), median wall time")  # fmt: skip
    rows = [] if args.chain_only or args.tree_only else measure(model, prompts, args)
    if rows:
        print(table(rows))
    report = {"machine": machine(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    if args.chain or args.chain_only or args.tree_budget:
        draft = MTPCModel.from_backbone(
            model.backbone, "btree", args.window, args.rank, lora_layers=args.lora
        )
    if args.chain or args.chain_only:
        print(f"speculative chain: btree n={args.window} r={args.rank} k={args.lora} (the "
              "target's MTP unembeddings, LoRA B = 0), greedy, policy=condition")  # fmt: skip
        report["chain"] = measure_chain(draft, prompts, args)
        print(chain_table(report["chain"]))
    if args.tree_budget:
        print(f"token tree cycle: {args.tree_budget} nodes and a pending root (a binary heap), "
              f"its rightmost path kept; the draft's tail k={args.lora}")  # fmt: skip
        report["tree"] = tree_table(draft, prompts, args)
    write_json(args.json, report, default=str)
    import json

    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
