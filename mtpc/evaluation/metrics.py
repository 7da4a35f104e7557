"""The paper's throughput metrics (Sec. 4.2) over decoding runs, and mean +- std over prompt sets.

Per prompt set (cycles pooled over its prompts):

* ``mu_lat``: mean wall time of a cycle (draft + verify + bookkeeping), seconds; for
  autoregressive decoding a cycle is one target step.
* ``mu_acc``: mean tokens appended per cycle, **counting the kept correction / bonus token**
  (accepted drafts + 1 with the ``condition`` / ``recompute`` policies; AR: 1). This is what
  the throughput divides: the tokens the user gets per cycle.
* ``mu_acc_drafts``: mean accepted drafts per cycle (the correction not counted), in [0, n].
* ``tok_s``: ``mu_acc / mu_lat`` (paper Eq. 2); ``wall_tok_s``: new tokens / total wall time
  including the prefill.
* ``acceptance``: per window position i (1..n), the share of cycles whose draft at position
  i was verified and accepted, among cycles that verified a draft there (position 1 is
  evidence, not a draft, after a kept correction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mtpc.decoding.common import GenerationResult

SCALARS = ("mu_lat", "mu_acc", "mu_acc_drafts", "tok_s", "wall_tok_s")


def set_metrics(results: Sequence[GenerationResult], window: int = 1) -> dict[str, Any]:
    """Metrics of one prompt set (see the module docstring)."""
    cycles = sum(len(r.cycle_seconds) for r in results)
    seconds = sum(sum(r.cycle_seconds) for r in results)
    emitted = sum(sum(r.emitted) for r in results)
    accepted = sum(sum(r.accepted) for r in results)
    tokens = sum(len(r.tokens) for r in results)
    wall = sum(r.seconds for r in results)
    mu_lat = seconds / max(1, cycles)
    mu_acc = emitted / max(1, cycles)
    tried = [0] * window
    hits = [0] * window
    for r in results:
        for s, m, pre in zip(r.accepted, r.drafted, r.offsets, strict=True):
            for j in range(pre, min(window, pre + m)):
                tried[j] += 1
                hits[j] += j - pre < s
    return {
        "mu_lat": mu_lat,
        "mu_acc": mu_acc,
        "mu_acc_drafts": accepted / max(1, cycles),
        "tok_s": mu_acc / mu_lat if mu_lat > 0 else 0.0,
        "wall_tok_s": tokens / wall if wall > 0 else 0.0,
        "cycles": cycles,
        "tokens": tokens,
        "acceptance": [h / t if t else float("nan") for h, t in zip(hits, tried, strict=True)],
    }


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def aggregate(per_set: Sequence[dict[str, Any]], keys: Sequence[str] = SCALARS) -> dict[str, Any]:
    """``{key: mean, key_std: std}`` over prompt sets, plus the mean acceptance per position."""
    out: dict[str, Any] = {}
    for key in keys:
        if all(key in m for m in per_set):
            out[key], out[f"{key}_std"] = mean_std([float(m[key]) for m in per_set])
    if per_set and "acceptance" in per_set[0]:
        columns = zip(*(m["acceptance"] for m in per_set), strict=True)
        out["acceptance"] = [mean_std(list(c))[0] for c in columns]
    return out
