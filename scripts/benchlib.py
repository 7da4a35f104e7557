"""The harness of ``scripts/bench_*.py``: timers and report helpers (the scripts' own, not the
package's; a device's peak memory is ``mtpc.evaluation.run.peak_memory_mb``).

Times are minima over rounds (other processes only ever add time). Peak RSS is this process's
since a reset (``clear_refs`` + ``VmHWM``): ``ru_maxrss`` cannot be reset and survives fork +
exec. torch is imported where needed, so a parent that only starts measuring children
(``scripts/bench_memory.py``) stays below their peak. A script imports it as ``benchlib``
(``python scripts/bench_x.py`` puts ``scripts/`` first on the path).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def best_time(
    fn: Callable[[], object], min_time: float = 0.3, warmup: int = 5, rounds: int = 7
) -> float:
    """Best (minimum) seconds per call over ``rounds`` rounds of at least ``min_time / 5``."""
    for _ in range(warmup):
        fn()
    once = max(timed(fn)[0], 1e-7)
    reps = max(1, int(min_time / 5 / once))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds of one call of ``fn``, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median_time(
    fn: Callable[[], T], repeats: int, device: str | torch.device = "cpu", warmup: int = 1
) -> tuple[float, T]:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` calls (on a CUDA
    ``device``, each call synchronised before and inside the timing), and the last result."""
    import torch

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda _: None
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result  # type: ignore[return-value]


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 where unavailable."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_extra_mb(fn: Callable[[], object]) -> float:
    """MiB the process's peak resident size rises above its resident size while ``fn`` runs
    (``VmHWM`` after a reset, minus ``VmRSS`` before): what the call allocates on top."""
    before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:  # VmHWM := the RSS (Linux >= 4.0)
        handle.write("5")
    fn()
    return (status_kb("VmHWM") - before) / 1024


def _call_and_put(fn: Callable[..., object], args: tuple[object, ...], queue: Any) -> None:
    queue.put(fn(*args))


def in_fresh_process(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a freshly spawned process (``fn`` a module-level function, its result
    picklable): its peak memory is its own, not shared with earlier measurements."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_call_and_put, args=(fn, args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def markdown_header(*columns: str) -> str:
    """The first two lines of a Markdown table."""
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def markdown_row(cells: Iterable[object]) -> str:
    """One Markdown table row of ``cells`` (formatted already, or ``str()``-ed; "" is ``| |``)."""
    return "|" + "".join(f" {cell} |" if str(cell) else " |" for cell in cells)


def machine() -> str:
    """This machine's processor (or architecture) name, for a report's first line."""
    return platform.processor() or platform.machine()


def write_json(path: str | Path | None, data: object, **options: Any) -> None:
    """Writes ``data`` as indented JSON to ``path`` (nothing when ``path`` is None)."""
    if path is not None:
        Path(path).write_text(json.dumps(data, **{"indent": 2, **options}))
