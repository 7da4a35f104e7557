"""The paper's throughput metrics (Sec. 4.2) from prompt records, and mean +- std over sets.
Per prompt set, cycles pooled over its prompts: ``mu_lat``, ``mu_acc`` (counting the kept
correction / bonus token), ``mu_acc_drafts`` (emitted drafts only) and ``tok_s`` as in
docs/DECODING.md, "Evaluator"; the records: docs/EVALUATION.md, "Records". Also:

* ``wall_tok_s``: new tokens / total wall time, prefill included.
* ``acceptance``: per window position i (1..n), the share of cycles whose draft at i was
  verified and accepted, among cycles that verified a draft there (position 1 is evidence,
  not a draft, after a kept correction).
* token trees: ``nodes`` = draft nodes verified per cycle; ``expected_drafts`` = accepted
  drafts per cycle the circuit predicts (the sum of q over the nodes), against
  ``mu_acc_drafts``; ``expected_acceptance`` = the predicted share per position.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from mtpc.decoding.common import GenerationResult

SCALARS = ("mu_lat", "mu_acc", "mu_acc_drafts", "tok_s", "wall_tok_s", "nodes", "expected_drafts")


def prompt_record(result: GenerationResult, per_cycle: bool = True) -> dict[str, Any]:
    """The measurements of one decoded prompt, as stored in ``records.jsonl``. ``per_cycle``:
    keep the per-cycle lists (``accepted``, ``drafted``, ``offsets``) the acceptance per
    position needs; False for runs with no drafts to judge. A cycle cut short inside its
    accepted drafts counts only the emitted ones as judged and accepted."""
    cycles = list(zip(result.accepted, result.emitted, result.drafted, strict=True))
    # s > e: max_new_tokens / a stop id ended the output inside the s accepted drafts
    accepted = [min(s, e) for s, e, _ in cycles]
    drafted = [e if s > e else m for s, e, m in cycles]
    record: dict[str, Any] = {
        "new_tokens": len(result.tokens), "cycles": len(result.cycle_seconds),
        "accepted_total": sum(accepted), "cycle_seconds": sum(result.cycle_seconds),
        "prefill_seconds": result.prefill_seconds, "seconds": result.seconds,
        "stopped": result.stopped, "engine": result.engine,
    }  # fmt: skip
    if per_cycle:
        record.update(accepted=accepted, drafted=drafted, offsets=list(result.offsets))
    if result.nodes:  # token trees: nodes verified, q's predicted acceptance per position
        by_position: list[float] = []
        for pre, probs in zip(result.offsets, result.expected, strict=True):
            by_position.extend([0.0] * (pre + len(probs) - len(by_position)))
            for d, prob in enumerate(probs):
                by_position[pre + d] += prob
        record.update(
            nodes_total=sum(result.nodes),
            expected_total=sum(map(sum, result.expected)),
            expected_by_position=by_position,
        )
    return record


def pool_turns(turns: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The record of a multi-turn prompt from its turns' records (:func:`prompt_record`):
    counts and times summed, per-cycle lists concatenated, ``stopped`` of the last turn, so
    that :func:`set_metrics` pools the cycles of every turn."""
    out: dict[str, Any] = {
        key: sum(t[key] for t in turns)
        for key in ("new_tokens", "cycles", "accepted_total", "cycle_seconds",
                    "prefill_seconds", "seconds", "nodes_total", "expected_total")
        if all(key in t for t in turns)
    }  # fmt: skip
    out["stopped"] = turns[-1]["stopped"]
    engines = {str(t["engine"]) for t in turns if t.get("engine")}  # older records: none
    if engines:  # turns on different engines show both: "compiled+static"
        out["engine"] = "+".join(sorted(engines))
    for key in ("accepted", "drafted", "offsets"):
        if all(key in t for t in turns):
            out[key] = [x for t in turns for x in t[key]]
    if all("expected_by_position" in t for t in turns):
        by_turn = itertools.zip_longest(*(t["expected_by_position"] for t in turns), fillvalue=0.0)
        out["expected_by_position"] = [sum(position) for position in by_turn]
    return out


def set_metrics(
    records: Sequence[Mapping[str, Any] | GenerationResult], window: int = 1
) -> dict[str, Any]:
    """Metrics of one prompt set from its prompt records (or decoding results); ``window``:
    the draft's n (the length of ``acceptance``)."""
    recs = [prompt_record(r) if isinstance(r, GenerationResult) else r for r in records]
    cycles = sum(r["cycles"] for r in recs)
    seconds = sum(r["cycle_seconds"] for r in recs)
    tokens = sum(r["new_tokens"] for r in recs)
    wall = sum(r["seconds"] for r in recs)
    mu_lat = seconds / max(1, cycles)
    mu_acc = tokens / max(1, cycles)  # sum(emitted) == new tokens
    # difference arrays: a cycle judges positions [pre, pre + m) and accepts [pre, pre + s)
    tried = [0] * (window + 1)
    hits = [0] * (window + 1)
    for r in recs:
        cols = (r.get("accepted", ()), r.get("drafted", ()), r.get("offsets", ()))  # per cycle
        for s, m, pre in zip(*cols, strict=True):
            if pre < window:
                tried[pre] += 1
                tried[min(window, pre + m)] -= 1
                hits[pre] += 1
                hits[min(window, pre + min(s, m))] -= 1
    tried = list(itertools.accumulate(tried[:window]))
    hits = list(itertools.accumulate(hits[:window]))
    tree = {}
    if recs and all("nodes_total" in r for r in recs):
        predicted = [0.0] * window
        for r in recs:
            for i, prob in enumerate(r["expected_by_position"][:window]):
                predicted[i] += prob
        tree = {
            "nodes": sum(r["nodes_total"] for r in recs) / max(1, cycles),
            "expected_drafts": sum(r["expected_total"] for r in recs) / max(1, cycles),
            "expected_acceptance": [
                p / t if t else float("nan") for p, t in zip(predicted, tried, strict=True)
            ],
        }
    return {
        "mu_lat": mu_lat,
        "mu_acc": mu_acc,
        "mu_acc_drafts": sum(r["accepted_total"] for r in recs) / max(1, cycles),
        "tok_s": mu_acc / mu_lat if mu_lat > 0 else 0.0,
        "wall_tok_s": tokens / wall if wall > 0 else 0.0,
        "cycles": cycles, "tokens": tokens, "prompts": len(recs),
        "acceptance": [h / t if t else float("nan") for h, t in zip(hits, tried, strict=True)],
        **tree,
    }  # fmt: skip


def tokens_sha1(tokens: Sequence[int]) -> str:
    """The hash of one output's new ids that records keep (``tokens_sha1``)."""
    return hashlib.sha1(json.dumps(list(tokens)).encode()).hexdigest()


def hetero_record(result: GenerationResult) -> dict[str, Any]:
    """One ``drafter=hetero`` prompt's (or its AR pass's) measurements in ``records.jsonl``."""
    return {
        "new_tokens": len(result.tokens),
        "cycles": len(result.accepted),  # target passes
        "accepted_total": sum(result.accepted),
        "drafter_passes": result.drafter_passes,
        "seconds": result.seconds,
        "tokens_sha1": tokens_sha1(result.tokens),
    }


def hetero_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """A prompt set's ``drafter=hetero`` row metrics from its prompts' :func:`hetero_record`
    values."""
    cycles = sum(r["cycles"] for r in records)
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {
        "mu_lat": seconds / max(cycles, 1),
        "mu_acc": tokens / max(cycles, 1),  # target tokens per target pass (cycle)
        "mu_acc_drafts": sum(r["accepted_total"] for r in records) / max(cycles, 1),
        "tok_s": tokens / seconds if seconds > 0 else 0.0,
        "drafter_passes_per_cycle": sum(r["drafter_passes"] for r in records) / max(cycles, 1),
        "cycles": float(cycles),
        "tokens": float(tokens),
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
    for key in ("acceptance", "expected_acceptance"):
        if per_set and all(key in m for m in per_set):
            columns = zip(*(m[key] for m in per_set), strict=True)
            out[key] = [mean_std(list(c))[0] for c in columns]
    return out
