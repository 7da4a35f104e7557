"""Uncertainty of comparisons: paired bootstrap intervals over prompts (:func:`paired_rows`),
and drafts merged over training seeds (:func:`seed_rows`), all from the prompt records. See
docs/EVALUATION.md, "Comparisons: paired intervals, seeds, interleaved timing".
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtpc.draft_fields import FREE_TO_CHANGE, flat_matters
from mtpc.evaluation.metrics import mean_std

RESAMPLES = 10_000  # bootstrap resamples of every paired interval
SEED = 0  # of the bootstrap's generator (numpy PCG64), the same for every comparison
LEVEL = 0.95  # coverage of the percentile intervals

PAIRED_NOTE = (
    "Paired by prompt (set, index): draft minus / over the reference on the prompts both "
    "decoded; per set, cycles pooled (Σ tokens / Σ cycles; tok/s: Σ tokens / Σ cycle "
    f"seconds), mean over sets; [95% CI]: percentile interval of {RESAMPLES} bootstrap "
    f"resamples of the prompts within each set, the same draws for both sides (seed {SEED})."
)
SEED_NOTE = (
    "Drafts whose training config differs only in seed, merged: mean ± std over seeds (sample "
    "std) of each seed's value (itself the mean over prompt sets); Δ and x vs: each seed's "
    "paired comparison with its reference."
)

BUDGET = ("trainer.max_steps", "trainer.max_epochs", "trainer.max_time", "trainer.fast_dev_run")
"""Fields that a resumed run may change but that shape the trained draft (its step budget)."""

SEED_FREE = ("seed", *(f for f in FREE_TO_CHANGE if f not in BUDGET))
"""Training fields that may differ between drafts merged over seeds: the seed and the fields
a resumed run may change, less the budget."""


# ------------------------------------------------------------------------- bootstrap ----
Pairs = Mapping[int, np.ndarray]
"""Per prompt set, (4, m): the rows numerator a, denominator a, numerator b, denominator b;
one column per paired prompt, in index order."""


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def paired_bootstrap(
    pairs: Pairs,
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """``(estimate, low, high)``: the mean over sets of ``combine(Σ num_a / Σ den_a,
    Σ num_b / Σ den_b)`` and its bootstrap percentile interval (each resample draws every
    set's prompts with replacement, the same indices for a and b); NaN with nothing to pair."""
    sets = [k for k in sorted(pairs) if len(pairs[k][0])]
    if not sets:
        return math.nan, math.nan, math.nan
    rng = np.random.Generator(np.random.PCG64(seed))
    estimate = 0.0
    boot = np.zeros(resamples)
    for k in sets:
        num_a, den_a, num_b, den_b = pairs[k]
        estimate += float(
            combine(_ratio(num_a.sum(), den_a.sum()), _ratio(num_b.sum(), den_b.sum()))
        )
        idx = rng.integers(0, len(num_a), size=(resamples, len(num_a)))  # (B, m): prompts drawn
        boot += combine(
            _ratio(num_a[idx].sum(1), den_a[idx].sum(1)),
            _ratio(num_b[idx].sum(1), den_b[idx].sum(1)),
        )  # (B,)
    boot /= len(sets)
    if not np.isfinite(boot).any():
        return estimate / len(sets), math.nan, math.nan
    tail = (1.0 - LEVEL) / 2 * 100
    low, high = np.nanpercentile(boot, [tail, 100 - tail])
    return estimate / len(sets), float(low), float(high)


def _prompt_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    return (record["set"], record["index"], record.get("prompt_id"))


def pair_records(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], numerator: str, denominator: str
) -> dict[int, np.ndarray]:
    """The :data:`Pairs` of two drafts' prompt records: the prompts both decoded, per set."""
    by_key = {_prompt_key(r): r for r in b}
    out: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for r in sorted(a, key=_prompt_key):
        other = by_key.get(_prompt_key(r))
        if other is not None:
            out[r["set"]].append(
                (r[numerator], r[denominator], other[numerator], other[denominator])
            )
    return {k: np.array(v, dtype=float).T for k, v in out.items()}  # (4, m) per set


def compare(
    a: Sequence[Mapping[str, Any]],
    b: Sequence[Mapping[str, Any]],
    ar: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The paired statistics of draft records ``a`` (one pass) against reference records
    ``b``: ``prompts`` (paired), ``delta_mu_acc``, ``ratio_tok_s`` and, with ``ar`` (the AR
    records of ``a``'s folder), ``speedup_ar``, each with ``*_low`` and ``*_high``."""
    tokens = pair_records(a, b, "new_tokens", "cycles")
    out: dict[str, Any] = {"prompts": sum(len(v[0]) for v in tokens.values())}
    stats = [
        ("delta_mu_acc", tokens, np.subtract),
        ("ratio_tok_s", pair_records(a, b, "new_tokens", "cycle_seconds"), np.divide),
    ]
    if ar:
        stats.append(("speedup_ar", pair_records(a, ar, "new_tokens", "cycle_seconds"), np.divide))
    for key, pairs, combine in stats:
        out[key], out[f"{key}_low"], out[f"{key}_high"] = paired_bootstrap(pairs, combine)
    return out


# ---------------------------------------------------------------------- paired table ----
def reference_of(rows: Sequence[Mapping[str, Any]], folders: Sequence[int]) -> list[int | None]:
    """The index of each report row's reference: its folder (``folders[i]``)'s first
    baseline draft, else the first baseline of all folders, else the first draft row; None
    for AR, drafter=hetero and the reference itself."""
    drafts = [i for i, r in enumerate(rows) if r.get("kind") != "ar" and r.get("pass") is not None]
    base = [i for i in drafts if rows[i].get("baseline")]
    own = {folders[i]: i for i in reversed(base)}  # each folder's first baseline
    fallback = base[0] if base else (drafts[0] if drafts else None)
    refs = [own.get(folders[i], fallback) for i in range(len(rows))]
    return [ref if i in drafts and ref not in (None, i) else None for i, ref in enumerate(refs)]


def paired_rows(
    rows: Sequence[Mapping[str, Any]],
    records: Sequence[Sequence[Mapping[str, Any]]],
    ar_records: Sequence[Sequence[Mapping[str, Any]]],
    folders: Sequence[int],
) -> list[dict[str, Any]]:
    """One paired comparison per draft row against its reference (:func:`reference_of`);
    per row: its prompt records, its folder's AR records, its folder index."""
    out = []
    for i, ref in enumerate(reference_of(rows, folders)):
        if ref is None:
            continue
        stats = compare(records[i], records[ref], ar_records[i])
        out.append(
            {"name": rows[i]["name"], "path": rows[i].get("path"), "pass": rows[i].get("pass"),
             "vs": rows[ref]["name"], "vs_path": rows[ref].get("path"), **stats,
             "resamples": RESAMPLES, "seed": SEED, "level": LEVEL}
        )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ seeds ----
def training_config(path: str | Path) -> dict[str, Any] | None:
    """The training config an exported draft's model card records (``python train.py``
    writes it), or None (no card, no such section, or unreadable)."""
    try:
        text = (Path(path) / "README.md").read_text(encoding="utf-8")
        section = re.search(r"## Training config.*?```json\n(.*?)\n```", text, re.DOTALL)
        config = json.loads(section[1]) if section else None
    except (OSError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


def configuration(
    training: Mapping[str, Any] | None, trainings: Mapping[str, Any] | None = None, depth: int = 0
) -> dict[str, Any] | None:
    """The settings that shape a trained draft but its seed (``MATTERS`` less
    :data:`SEED_FREE`), flattened, or None without a recorded ``seed``; ``init_from`` is
    replaced by that draft's own configuration, so a two-stage recipe's seeds group too."""
    if not training or "seed" not in training:
        return None
    flat = {
        k: v
        for k, v in flat_matters(training).items()
        if not any(k == f or k.startswith(f + ".") for f in SEED_FREE)
    }
    init = flat.get("init_from")
    if isinstance(init, str) and depth < 4:
        parent = (trainings or {}).get(init) or training_config(init)
        inner = configuration(parent, trainings, depth + 1)
        if inner is not None:
            flat["init_from"] = {"configuration": inner}
    return flat


def seed_rows(
    rows: Sequence[Mapping[str, Any]],
    trainings: Mapping[str, Any],
    paired: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Draft rows merged over seeds: one row per configuration with two or more drafts, each
    statistic (and ``paired``'s Δ and ratio) with its mean, ``*_std`` and ``*_values``."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    configs: dict[tuple[str, Any], dict[str, Any]] = {}
    for draft_row in rows:
        if draft_row.get("kind") == "ar" or draft_row.get("pass") is None:
            continue
        training = trainings.get(str(draft_row.get("path")))
        config = configuration(training, trainings)
        if config is None:
            continue
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        key = (digest.hexdigest(), draft_row.get("pass"))
        groups[key].append({**draft_row, "seed": training["seed"] if training else None})
        configs[key] = config
    merged = {k: v for k, v in groups.items() if len(v) > 1}
    by_paired = {(p["path"], p["pass"]): p for p in paired}
    labels = {k: _label(v[0], k[1]) for k, v in merged.items()}
    for label in set(labels.values()):
        same = [k for k in merged if labels[k] == label]
        if len(same) > 1:  # name the fields that tell these configurations apart
            first = configs[same[0]]
            common = {f for f in first if all(configs[k].get(f, ...) == first[f] for k in same)}
            fields = sorted({f for k in same for f in configs[k]} - common)
            for k in same:
                shown = ", ".join(f"{f}={configs[k].get(f)}" for f in fields[:3])
                labels[k] = f"{label} [{shown}{', ...' if len(fields) > 3 else ''}]"
    group_of = {  # a reference draft's configuration label (speculative rows)
        str(m.get("path")): labels[k] for k, v in merged.items() for m in v if k[1] == "speculative"
    }
    out = []
    for key, members in merged.items():
        members = sorted(members, key=lambda r: (str(r["seed"]), str(r.get("path"))))
        row: dict[str, Any] = {
            "name": labels[key], "pass": key[1], "configuration": key[0][:12],
            "seeds": ",".join(str(m["seed"]) for m in members), "drafts": len(members),
            "members": [m["name"] for m in members], "paths": [m.get("path") for m in members],
        }  # fmt: skip
        for stat in ("mu_acc", "mu_acc_drafts", "tok_s", "speedup_ar", "speedup_baseline"):
            values = [float(m[stat]) for m in members if m.get(stat) is not None]
            if values:
                row[stat], row[f"{stat}_std"] = mean_std(values)
                row[f"{stat}_values"] = values
        comparisons = [by_paired.get((m.get("path"), m.get("pass"))) for m in members]
        if all(c is not None for c in comparisons):
            refs = sorted({group_of.get(str(c["vs_path"]), str(c["vs"])) for c in comparisons if c})
            row["vs"] = ", ".join(refs) if len(refs) <= 2 else f"{len(refs)} references"
            for stat in ("delta_mu_acc", "ratio_tok_s"):
                values = [float(c[stat]) for c in comparisons if c]
                row[stat], row[f"{stat}_std"] = mean_std(values)
                row[f"{stat}_values"] = values
        out.append(row)
    return out


def _label(row: Mapping[str, Any], pass_name: Any) -> str:
    label = (
        f"{row.get('kind')} n={row.get('window')} r={row.get('rank')} k={row.get('lora_layers')}"
    )
    return label if pass_name == "speculative" else f"{label} {pass_name}"
