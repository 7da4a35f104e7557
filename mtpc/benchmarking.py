"""Measurement helpers shared by ``scripts/bench_*.py`` (never used in tests' assertions).

* :func:`best_time`: minimum seconds per call over rounds. The minimum, not the median: on
  a shared machine other processes only ever add time.
* :func:`reset_peak_rss` / :func:`status_kb`: the peak resident set size of *this* process
  since a reset (Linux ``/proc/self/clear_refs`` + ``VmHWM``); ``ru_maxrss`` cannot be
  reset and survives fork + exec, so it reports a parent's peak.
* :func:`cuda_index`, :func:`sync_memory_reset`, :func:`peak_memory_mb`: a device's peak
  memory (CUDA: allocated on that GPU, never the current one by accident; CPU: the
  process's peak RSS), used by the evaluation, the benchmarks and ``scripts/check_gpu.py``.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable

import torch


def best_time(
    fn: Callable[[], object], min_time: float = 0.3, warmup: int = 5, rounds: int = 7
) -> float:
    """Best (minimum) seconds per call over ``rounds`` rounds of at least ``min_time / 5``."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_time / 5 / once))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


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


def reset_peak_rss() -> None:
    """Resets ``VmHWM`` to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def cuda_index(device: str) -> int | None:
    """The CUDA device index of ``device`` (``cuda`` -> the current one); None for the CPU."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else int(index)


def sync_memory_reset(device: str) -> None:
    """Waits for ``device``'s work and restarts its peak-memory counter (CUDA only)."""
    index = cuda_index(device)
    if index is not None:
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)


def peak_memory_mb(device: str) -> float:
    """Peak memory in MiB: allocated on ``device``'s GPU since the last reset, or the
    process's peak RSS on the CPU (``ru_maxrss``: never reset)."""
    index = cuda_index(device)
    if index is not None:
        return torch.cuda.max_memory_allocated(index) / 2**20
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
