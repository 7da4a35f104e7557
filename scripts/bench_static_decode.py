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

The compiled graphs are built first (``warm-up`` column: seconds of the first call, which
compiles the step at this B and the prefill chunk) and are not timed. Cells alternate
between repeats; a cell's wall time is the median over the repeats.

    python scripts/bench_static_decode.py                               # inductor, B = 1, 8
    python scripts/bench_static_decode.py --backend aot_eager --sizes 1 4 16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from bench_batch import _prompts
from torch.utils._python_dispatch import TorchDispatchMode

from mtpc.benchmarking import machine, markdown_header, markdown_row, timed, write_json


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
    from mtpc.decoding.layout import Padded, Stream
    from mtpc.decoding.static import StaticLayout, capacity_for, engine_for

    device = model.backbone.device
    batch = [torch.tensor(p, device=device) for p in (prompts * size)[:size]]
    rows = [object() for _ in batch]
    longest = max(len(p) for p in batch) + args.steps + 2
    eager = Stream(model) if size == 1 else Padded(model)
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


def measure(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """One row per B: the calls' tokens/s eager and compiled, and the step alone."""
    from mtpc.decoding import generate

    seeds = list(range(len(prompts)))

    def call(size: int, compile: bool | str, new: int = args.max_new_tokens) -> list[Any]:
        return generate(model, prompts, new, method="autoregressive", seed=seeds,
                        batch_size=size, suppress_eos=True, compile=compile)  # fmt: skip

    warm = {}
    for size in args.sizes:  # compiles this B's graphs (decode step, prefill chunk)
        warm[size] = timed(lambda size=size: call(size, args.backend, 2))[0]
        call(size, False, 2)
    cells = [(size, how) for size in args.sizes for how in (False, args.backend)]
    walls: dict[tuple[int, Any], list[float]] = {cell: [] for cell in cells}
    outputs: dict[tuple[int, Any], list[Any]] = {}
    for k in range(args.repeats):
        shift = k % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            seconds, outputs[cell] = timed(lambda cell=cell: call(*cell))
            walls[cell].append(seconds)
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
    args = parser.parse_args(argv)
    if not args.sizes or min(args.sizes) < 1 or min(args.prompts, args.repeats, args.steps) < 1:
        parser.error("--sizes, --prompts, --steps and --repeats: allowed: ints >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints its table and JSON and returns (with ``--json`` writes) it."""
    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel

    args = parse(argv)
    torch.set_num_threads(args.threads)
    model = MTPCModel.target_only(load_backbone("tiny", device=args.device))
    context = int(model.backbone.config.max_position_embeddings)
    prompts = _prompts(args.prompts, "tiny", context - args.max_new_tokens - 1)
    lengths = [len(p) for p in prompts]
    print(f"machine: {machine()}, {args.threads} thread(s), {args.device}, torch "
          f"{torch.__version__}; backend {args.backend}; {len(prompts)} prompts of "
          f"{min(lengths)}-{max(lengths)} ids, {args.max_new_tokens} new tokens each, "
          f"{args.repeats} repeat(s), median wall time")  # fmt: skip
    rows = measure(model, prompts, args)
    print(table(rows))
    report = {"machine": machine(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    write_json(args.json, report, default=str)
    import json

    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
