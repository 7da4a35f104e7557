"""Reports rebuilt from an evaluation's records alone (tables, results.json, CSVs, plots):
``evaluate`` calls :func:`report_folders` after decoding, and ``report=`` rebuilds the same
report. See docs/EVALUATION.md.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtpc.evaluation.metrics import aggregate, hetero_metrics, mean_std, set_metrics
from mtpc.evaluation.records import (
    ar_turn_hashes,
    check_mergeable,
    equal_turns,
    hetero_draft_path,
    read_manifest,
    read_records,
    turn_hashes,
)
from mtpc.evaluation.statistics import (
    PAIRED_NOTE,
    SEED_NOTE,
    paired_rows,
    seed_rows,
    training_config,
)
from mtpc.store import write_json

COLUMNS = (
    ("name", "draft", "{}"),
    ("kind", "kind", "{}"),
    ("window", "n", "{}"),
    ("rank", "r", "{}"),
    ("lora_layers", "k", "{}"),
    ("mu_lat", "mu_lat ms", "ms"),
    ("mu_acc", "mu_acc tok/cyc", "2f"),
    ("mu_acc_drafts", "acc drafts", "2f"),
    ("nodes", "nodes/cyc", "1f"),
    ("expected_drafts", "q-pred drafts", "2f"),
    ("tok_s", "tok/s", "1f"),
    ("max_tok_s", "max tok/s", "1f"),
    ("speedup_ar", "x AR", "2f"),
    ("speedup_baseline", "x baseline", "2f"),
    ("exact", "= AR", "{}"),
    ("peak_memory_mb", "peak MB", "0f"),
)
SOURCE_STATS = ("mu_acc", "mu_acc_drafts", "nodes", "expected_drafts", "tok_s", "speedup_ar")
SOURCE_COLUMNS = (
    COLUMNS[0],
    ("source", "source", "{}"),
    ("prompts", "prompts", "{}"),
    *(c for c in COLUMNS if c[0] in SOURCE_STATS),
)
SPEC_BENCH_COLUMNS = (
    ("name", "draft", "{}"),
    ("task", "category", "{}"),
    ("questions", "questions", "{}"),
    ("turns", "turns", "{}"),
    ("mu_acc", "tok/cyc (ours) = mean accepted (SB)", "2f"),
    ("tok_s", "tok/s (ours)", "1f"),
    ("speedup_ar", "x AR (ours)", "2f"),
    ("sb_tok_s", "tok/s (SB)", "1f"),
    ("sb_speedup", "x AR (SB)", "2f"),
    ("exact", "= AR turns", "{}"),
)
SPEC_BENCH_NOTE = (
    "tok/cyc (ours): new tokens / cycles, cycles pooled, the correction/bonus token counted "
    "(AR 1.00) = Spec-Bench's mean accepted tokens. tok/s (ours): tok/cyc / mean cycle time "
    "(prefill excluded); x AR (ours): tok/s / AR's, per run. tok/s (SB): per question, new "
    "tokens / wall time of all its turns (prefill included), mean over questions; x AR (SB): "
    "mean tok/s (SB) / AR's mean tok/s (SB), per run. Mean ± std over runs "
    "(num_prompt_sets); mt_bench pools MT-bench's 8 categories."
)
PAIRED_COLUMNS = (
    ("name", "draft", "{}"),
    ("vs", "vs", "{}"),
    ("prompts", "paired prompts", "{}"),
    ("delta_mu_acc", "Δ tok/cyc [95% CI]", "2f"),
    ("ratio_tok_s", "x vs tok/s [95% CI]", "3f"),
    ("speedup_ar", "x AR [95% CI]", "2f"),
)
SEED_COLUMNS = (
    ("name", "configuration", "{}"),
    ("seeds", "seeds", "{}"),
    ("drafts", "drafts", "{}"),
    *(c for c in COLUMNS if c[0] in ("mu_acc", "mu_acc_drafts", "tok_s", "speedup_ar")),
    ("vs", "vs", "{}"),
    ("delta_mu_acc", "Δ tok/cyc", "2f"),
    ("ratio_tok_s", "x vs tok/s", "3f"),
)
HETERO_PASSES = ("hetero_ar", "hetero")
"""Record passes of ``drafter=hetero``: the target alone and drafted by the other vocabulary."""


def hetero_row_name(algorithm: str) -> str:
    """The row (and record ``draft``) name of a ``drafter=hetero`` evaluation."""
    return f"hetero:{algorithm}"


TIMING = ("mu_lat", "tok_s", "wall_tok_s", "max_tok_s", "speedup_ar", "speedup_baseline")
"""Row fields that depend on timing (the rest is a function of the decoded tokens)."""


def _undefined(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """``value ± std``, a paired statistic's ``estimate [low, high]``, ``-`` when undefined."""
    value: Any = row.get(key)
    if _undefined(value):
        return "-"
    if fmt == "{}":
        return str(value)
    paired = f"{key}_low" in row
    scale, spec = (1e3, ".3f") if fmt == "ms" else (1.0, f".{fmt}")
    text = format(value * scale, "+" + spec if paired and key.startswith("delta") else spec)
    low, high, std = (row.get(f"{key}_{end}", math.nan) for end in ("low", "high", "std"))
    if paired and not (_undefined(low) or _undefined(high)):
        text += f" [{format(low, spec)}, {format(high, spec)}]"
    elif not paired and not _undefined(std) and key != "peak_memory_mb":
        text += " ± " + format(std * scale, spec)
    return text


def format_table(
    rows: Sequence[dict[str, Any]],
    title: str = "",
    columns: Sequence[tuple[str, str, str]] = COLUMNS,
    note: str = "",
) -> str:
    """A markdown table (mean ± std where a ``*_std`` field exists), ``note`` below it."""
    header = [label for _, label, _ in columns]
    body = [[_cell(r, key, fmt) for key, _, fmt in columns] for r in rows]
    widths = [max([len(h), *(len(b[i]) for b in body)]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    lines = [title] if title else []
    return "\n".join([*lines, line(header), rule, *map(line, body), *([note] if note else [])])


def _by_set(records: Sequence[Mapping[str, Any]], window: int) -> dict[int, dict[str, Any]]:
    """Metrics per prompt set index (sets with no record are absent)."""
    groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r["set"], r["index"])):
        groups[r["set"]].append(r)
    return {k: {"set": k, **set_metrics(v, window)} for k, v in sorted(groups.items())}


def _row(name: str, per_set: dict[int, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    sets = list(per_set.values())
    prompts = sum(m["prompts"] for m in sets)
    return {"name": name, **extra, **aggregate(sets), "prompts": prompts, "per_set": sets}


def _ratios(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> list[float]:
    """Per set that both have: ``a``'s tok/s over ``b``'s (sets where ``b`` has none left out)."""
    return [a[k]["tok_s"] / b[k]["tok_s"] for k in a if k in b and b[k]["tok_s"] > 0]


def ratio(x: float, y: float) -> float:
    """``x / y``, NaN when ``y`` is not positive (no throughput to compare with)."""
    return x / y if y > 0 else math.nan


def _draft_passes(drafts: Sequence[Mapping[str, Any]], passes: Any) -> list[tuple[Any, str, str]]:
    """(draft, pass, row name): each draft's chain, then its ``tree<B>`` passes by budget."""
    trees = sorted(
        {p for p in passes if p.startswith("tree")}, key=lambda p: int(p.removeprefix("tree"))
    )
    return [
        (d, p, d["name"] if p == "speculative" else f"{d['name']} {p}")
        for d in drafts
        for p in ("speculative", *trees)
    ]


def _exact(records: Sequence[Mapping[str, Any]], per_turn: bool = False) -> str | None:
    """The ``= AR`` cell: greedy outputs equal to AR's / checked (``per_turn``: each turn's)."""
    checked = [
        bool(t["equal_reference"])
        for r in records
        for t in (r.get("turns", [r]) if per_turn else [r])
        if t.get("equal_reference") is not None
    ]
    return f"{sum(checked)}/{len(checked)}" if checked else None


def resolve_checks(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``records`` with the greedy check of the ``check_pending`` ones (``interleave=true``)
    done against AR's record of the same prompt; null while AR's is missing."""
    if not any(r.get("check_pending") for r in records):
        return list(records)
    ar = ar_turn_hashes(records)
    out: list[Mapping[str, Any]] = []
    for r in records:
        ref = ar.get((r["set"], r["index"])) if r.get("check_pending") else None
        if ref is not None:
            equal = equal_turns(turn_hashes(r), ref)
            r = {**r, "equal_reference": all(equal)}
            if r.get("turns"):
                r["turns"] = [
                    {**t, "equal_reference": e} for t, e in zip(r["turns"], equal, strict=True)
                ]
        out.append(r)
    return out


Groups = defaultdict[tuple[Any, str], list[Mapping[str, Any]]]


def prompt_groups(records: Sequence[Mapping[str, Any]]) -> Groups:
    """The prompt records by (draft path, pass), in record order."""
    groups: Groups = defaultdict(list)
    for r in records:
        if r.get("type") == "prompt":
            groups[(r.get("draft_path"), r["pass"])].append(r)
    return groups


def build_report(
    manifest: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows (AR, then each draft's chain and tree rows in manifest order; mean ± std over
    sets) and per-source rows (the cycles of every set pooled) of one evaluation folder."""
    groups = prompt_groups(resolve_checks(records))
    peaks: defaultdict[Any, float] = defaultdict(float)  # per draft path (AR: None)
    for r in records:
        if r.get("type") == "pass" and r.get("peak_memory_mb") is not None:
            peaks[r["draft_path"]] = max(peaks[r["draft_path"]], float(r["peak_memory_mb"]))
    settings = manifest["settings"]
    ar_recs = groups[(None, "ar")]
    ar = _by_set(ar_recs, 1)
    rows = [_row("AR (target)", ar, kind="ar", peak_memory_mb=peaks.get(None))] if ar else []
    source_rows: list[dict[str, Any]] = []
    for d, pass_name, name in _draft_passes(manifest["drafts"], [p for _, p in groups]):
        sd_recs = groups[(d["path"], pass_name)]
        if pass_name != "speculative" and not sd_recs:
            continue
        sd = _by_set(sd_recs, d["window"])
        row = _row(
            name, sd, path=d["path"], **{"pass": pass_name}, kind=d["kind"],
            window=d["window"], rank=d["rank"],
            lora_layers=d["lora_layers"], policy=settings.get("policy"),
            draft_rule=next((r.get("draft_rule") for r in sd_recs), None),
            baseline=bool(d.get("baseline")) and pass_name == "speculative",
            peak_memory_mb=peaks.get(d["path"]), exact=_exact(sd_recs),
        )  # fmt: skip
        mx = _by_set(groups[(d["path"], "max_throughput")], d["window"])
        maxima = [m["tok_s"] for m in mx.values()] if pass_name == "speculative" else []
        for key, values in (("speedup_ar", _ratios(sd, ar)), ("max_tok_s", maxima)):
            if values:
                row[key], row[f"{key}_std"] = mean_std(values)
        rows.append(row)
        for source in sorted({r["source"] for r in sd_recs}):
            m = set_metrics([r for r in sd_recs if r["source"] == source], d["window"])
            a = set_metrics([r for r in ar_recs if r["source"] == source])
            source_rows.append(
                {"name": name, "path": d["path"], "source": source, **m,
                 "speedup_ar": ratio(m["tok_s"], a["tok_s"])}
            )  # fmt: skip
    hetero_rows, hetero_sources = hetero_report(settings, records, with_ar=not ar)
    return rows + hetero_rows, source_rows + hetero_sources


def spec_bench_report(
    manifest: Mapping[str, Any], records: Sequence[Mapping[str, Any]], with_ar: bool = True
) -> list[dict[str, Any]]:
    """``prompts=spec_bench``: per Spec-Bench category, ``mt_bench`` and ``overall``, for AR
    (``with_ar``: a merged report takes the first folder's) and every chain and tree pass,
    the field's metrics and ours (:data:`SPEC_BENCH_NOTE`); none for other prompts."""
    from mtpc.data.spec_bench import MT_BENCH, MT_BENCH_CATEGORIES, OVERALL

    if (manifest.get("data") or {}).get("prompts") != "spec_bench":
        return []
    prompts = [r for r in resolve_checks(records) if r.get("type") == "prompt"]
    categories = list(dict.fromkeys(r["source"] for r in prompts))
    tasks = [(c, {c}) for c in categories]
    mt = [c for c in categories if c in MT_BENCH_CATEGORIES]
    if mt:
        tasks.append((MT_BENCH, set(mt)))
    tasks.append((OVERALL, set(categories)))
    ar_recs = [r for r in prompts if r["pass"] == "ar" and r.get("draft_path") is None]
    passes = [(None, "ar", "AR (target)", 1)] if with_ar else []
    drafted = _draft_passes(manifest["drafts"], [r["pass"] for r in prompts])
    passes += [(d["path"], p, name, d["window"]) for d, p, name in drafted]
    rows = []
    for path, pass_name, name, window in passes:
        recs = [r for r in prompts if r.get("draft_path") == path and r["pass"] == pass_name]
        if not recs:
            continue
        for task, members in tasks:
            mine = [r for r in recs if r["source"] in members]
            ar = [r for r in ar_recs if r["source"] in members]
            per_set = []
            for k in sorted({r["set"] for r in mine}):
                in_set = [r for r in mine if r["set"] == k]
                ar_set = [r for r in ar if r["set"] == k]
                m, a = set_metrics(in_set, window), set_metrics(ar_set)
                sb = _sb_tok_s(in_set)
                per_set.append(
                    {"set": k, "mu_acc": m["mu_acc"], "tok_s": m["tok_s"],
                     "speedup_ar": ratio(m["tok_s"], a["tok_s"]),
                     "sb_tok_s": sb, "sb_speedup": ratio(sb, _sb_tok_s(ar_set))}
                )  # fmt: skip
            row: dict[str, Any] = {
                "name": name, "path": path, "task": task, "pass": pass_name,
                "questions": len({r["prompt_id"] for r in mine}),  # per run
                "turns": sum(len(r.get("turns", [r])) for r in mine) // max(1, len(per_set)),
                "exact": _exact(mine, per_turn=True),
                "per_set": per_set,
            }  # fmt: skip
            row |= aggregate(per_set, ("mu_acc", "tok_s", "speedup_ar", "sb_tok_s", "sb_speedup"))
            rows.append(row)
    return rows


def _sb_tok_s(records: Sequence[Mapping[str, Any]]) -> float:
    """Spec-Bench's tok/s: per question, new tokens / wall seconds of all its turns, averaged."""
    rates = [r["new_tokens"] / r["seconds"] for r in records if r["seconds"] > 0]
    return sum(rates) / len(rates) if rates else math.nan


def hetero_report(
    settings: Mapping[str, Any], records: Sequence[Mapping[str, Any]], with_ar: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and per-source rows of ``drafter=hetero`` from its records (none without them);
    ``x AR`` against the target alone (``hetero_ar``), which ``with_ar`` adds as the AR row (a
    folder with no self-speculative draft has no other)."""
    drafter = settings.get("drafter") or {}
    key = hetero_draft_path(drafter)
    prompts = [r for r in records if r.get("type") == "prompt" and r.get("draft_path") == key]
    if not drafter or not prompts:
        return [], []
    sets = sorted({r["set"] for r in prompts})
    ar_sets, sd_sets = (  # per pass of HETERO_PASSES: per set
        [
            {"set": k, **hetero_metrics([r for r in prompts if (r["pass"], r["set"]) == (p, k)])}
            for k in sets
        ]
        for p in HETERO_PASSES
    )
    for sd, ar in zip(sd_sets, ar_sets, strict=True):
        sd["speedup_ar"] = ratio(sd["tok_s"], ar["tok_s"])
    algorithm = str(drafter.get("algorithm", "slem"))
    name = hetero_row_name(algorithm)
    count = {p: sum(1 for r in prompts if r["pass"] == p) for p in HETERO_PASSES}
    rows = []
    if with_ar:
        rows.append(
            {"name": "AR (target)", "kind": "ar", **aggregate(ar_sets), "per_set": ar_sets,
             "prompts": count["hetero_ar"]}
        )  # fmt: skip
    overlap = next(
        (r for r in records if r.get("type") == "overlap" and r["draft_path"] == key), None
    )
    if overlap is not None:  # the record's measurements only
        overlap = {k: v for k, v in overlap.items() if k not in ("type", "draft_path")}
    row = {
        "name": name, "kind": algorithm, "lookahead": drafter.get("lookahead"),
        **aggregate(sd_sets), "per_set": sd_sets, "prompts": count["hetero"], "overlap": overlap,
    }  # fmt: skip
    row["speedup_ar"], row["speedup_ar_std"] = mean_std([m["speedup_ar"] for m in sd_sets])
    source_rows = []
    for source in sorted({r["source"] for r in prompts}):
        sd_recs, ar_recs = (
            [r for r in prompts if (r["pass"], r["source"]) == (p, source)]
            for p in ("hetero", "hetero_ar")
        )
        m, a = hetero_metrics(sd_recs), hetero_metrics(ar_recs)
        source_rows.append(
            {"name": name, "source": source, "prompts": len(sd_recs), **m,
             "speedup_ar": ratio(m["tok_s"], a["tok_s"])}
        )  # fmt: skip
    return [*rows, row], source_rows


def trainings(manifests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each draft's training config: the one its evaluation recorded in the manifest
    (``training``), else its model card's if the folder is still there, else None."""
    out: dict[str, Any] = {}
    for manifest in manifests:
        recorded = manifest.get("training") or {}
        for d in manifest["drafts"]:
            path = str(d["path"])
            out[path] = recorded[path] if path in recorded else training_config(path)
    return out


def title_of(manifest: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] = ()) -> str:
    """The table's title line: decoding mode, prompt sets, device (and what is missing)."""
    s = manifest["settings"]
    prompts, unit = s.get("num_prompts"), "prompts"
    if (manifest.get("data") or {}).get("prompts") == "spec_bench":
        sets = max(1, int(s.get("num_prompt_sets") or 1))
        decoded = max((r.get("prompts", 0) for r in rows), default=0) // sets
        prompts = f"{decoded} of {manifest['data'].get('questions')}"
        unit = "Spec-Bench questions (every turn)"
    title = (
        f"{'greedy' if s.get('greedy', True) else 'sampling'} | policy={s.get('policy')} | "
        f"{s.get('num_prompt_sets')} set(s) x {prompts} {unit} x "
        f"{s.get('max_new_tokens')} bytes | device={s.get('device')}"
    )
    if s.get("sources"):
        title += f" | sources={','.join(s['sources'])}"
    if s.get("interleave"):
        title += " | interleaved"
    if s.get("batch_size"):  # times are the rows' shares of batch cycles
        title += f" | batch_size={s['batch_size']} (times: each row's share)"
    if s.get("compile"):  # the AR baseline on the compiled engine (records: "engine")
        title += f" | AR compiled ({s['compile']})"
    expected = max((r.get("prompts", 0) for r in rows), default=0)
    partial = [r["name"] for r in rows if "prompts" in r and r["prompts"] < expected]
    if partial:
        title += f" | INCOMPLETE: {', '.join(partial)}"
    return title + " | mu_acc counts the kept correction/bonus token"


def spec_bench_title(manifest: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """The Spec-Bench table's title: the file, its fingerprint, the selection and how many
    questions were decoded (fewer: left out as too long for the context, or num_prompts)."""
    data, s = manifest["data"], manifest["settings"]
    decoded = max((r["questions"] for r in rows if r["task"] == "overall"), default=0)
    title = (
        f"Spec-Bench {data.get('file')} (sha256 {str(data.get('sha256'))[:12]}): "
        f"{decoded} of {data.get('questions')} selected questions decoded"
    )
    for key in ("categories", "per_category", "turns"):
        if data.get(key) is not None:
            title += f" | prompts.{key}={data[key]}"
    if s.get("num_prompts") is not None:
        title += f" | num_prompts={s['num_prompts']}"
    runs = f" | {s.get('num_prompt_sets')} run(s) x {s.get('max_new_tokens')} bytes per turn"
    return title + runs


def report_folders(
    folders: Sequence[Path], out_dir: Path, plots: bool = True, echo: bool = True
) -> dict[str, Any]:
    """Tables, results.json, CSVs and plots of one evaluation folder or several merged
    (docs/EVALUATION.md, "Reports without decoding, and merging folders"), written to
    ``out_dir``; returns what results.json holds. ``echo``: print the tables. RecordsError:
    the folders cannot be merged."""
    manifests = [read_manifest(f) for f in folders]
    check_mergeable(manifests, folders)
    source_rows: list[dict[str, Any]] = []
    spec_rows: list[dict[str, Any]] = []
    placed: list[tuple[dict[str, Any], int]] = []  # (row, its folder's index)
    prompts_of: list[Groups] = []  # per folder: prompt records by (draft path, pass)
    for index, (folder, manifest) in enumerate(zip(folders, manifests, strict=True)):
        records = read_records(folder)
        folder_rows, folder_sources = build_report(manifest, records)
        placed += [(r, index) for r in folder_rows if index == 0 or r["kind"] != "ar"]
        source_rows += folder_sources
        spec_rows += spec_bench_report(manifest, records, with_ar=index == 0)
        prompts_of.append(prompt_groups(records))
    placed.sort(key=lambda p: bool(p[0].get("baseline")))  # baselines last (stable)
    rows = [r for r, _ in placed]
    base = [r for r in rows if r.get("baseline")]
    if len(base) == 1:  # x baseline: per set, tok/s over the baseline draft's
        ref = {m["set"]: m for m in base[0]["per_set"]}
        for row in rows:
            ratios = _ratios({m["set"]: m for m in row["per_set"]}, ref)
            row["speedup_baseline"], row["speedup_baseline_std"] = mean_std(ratios)
    where = [i for _, i in placed]
    paired = paired_rows(
        rows,
        [prompts_of[i].get((r.get("path"), str(r.get("pass"))), []) for r, i in placed],
        [prompts_of[i].get((None, "ar"), []) for i in where],
        where,
    )
    seeds = seed_rows(rows, trainings(manifests), paired)
    first = manifests[0]
    merged = f" | {len(folders)} folders merged" if len(folders) > 1 else ""
    table = format_table(rows, title_of(first, rows) + merged)
    source_table = format_table(
        source_rows, "per source (cycles of every set pooled)", SOURCE_COLUMNS
    )
    seeds_title = f"over seeds ({len(seeds)} configuration{'s' if len(seeds) > 1 else ''})"
    refs = sorted({str(p["vs"]) for p in paired})
    vs = f"paired vs {refs[0]}" if len(refs) == 1 else "paired vs each row's reference (vs)"
    extra = {  # the tables only some reports have, in print order: {key: (rows, table)}
        "spec_bench": (spec_rows, format_table(
            spec_rows, spec_bench_title(first, spec_rows), SPEC_BENCH_COLUMNS, SPEC_BENCH_NOTE
        )),
        "paired": (paired, format_table(paired, vs, PAIRED_COLUMNS, PAIRED_NOTE)),
        "seeds": (seeds, format_table(seeds, seeds_title, SEED_COLUMNS, SEED_NOTE)),
    }  # fmt: skip
    if echo:  # the main table always, the others when they have rows
        shown = [(source_rows, source_table), *extra.values()]
        print("\n".join([table, *(t for r, t in shown if r)]))
    results: dict[str, Any] = {
        **{k: first.get(k) for k in ("settings", "target", "data", "device_name")},
        "drafts": [d for m in manifests for d in m["drafts"]],
        "folders": [str(f) for f in folders],
        "provenance": [s for m in manifests for s in m.get("sessions", [])],
        "rows": rows,
        "by_source": source_rows,
        "table": table,
        "source_table": source_table,
    }
    for key, (extra_rows, extra_table) in extra.items():
        if extra_rows:
            results.update({key: extra_rows, f"{key}_table": extra_table})
    results["files"] = write_outputs(results, out_dir, plots=plots)
    return results


def write_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> dict[str, str]:
    """results.json (strict JSON: NaN is null), results.csv, by_source.csv and the plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = results["rows"]
    csvs = {"results": rows, "by_source": results.get("by_source", [])}
    csvs |= {k: results[k] for k in ("paired", "seeds", "spec_bench") if results.get(k)}
    files = {"json": str(out_dir / "results.json")}
    for name, table_rows in csvs.items():  # the scalar fields, sorted
        key = "csv" if name == "results" else f"{name}_csv"
        files[key] = str(out_dir / f"{name}.csv")
        keys = {k for r in table_rows for k, v in r.items() if not isinstance(v, list | dict)}
        with open(files[key], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted(keys), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(table_rows)
    if results.get("spec_bench"):
        files["spec_bench_md"] = str(out_dir / "spec_bench.md")
        Path(files["spec_bench_md"]).write_text(results["spec_bench_table"] + "\n")
    if plots and rows:
        files.update(write_plots(rows, out_dir))
    write_json(Path(files["json"]), {**results, "files": files})
    return files


def write_plots(rows: Sequence[dict[str, Any]], out_dir: Path) -> dict[str, str]:
    """tradeoff.png (paper Fig. 1: tokens per cycle vs latency, iso-throughput lines) and
    acceptance.png (acceptance rate per window position, one line per draft)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[str, Any] = {}
    timed = [r for r in rows if r.get("mu_lat") is not None and r.get("tok_s")]
    if timed:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        lats = [r["mu_lat"] * 1e3 for r in timed]
        accs = [r["mu_acc"] for r in timed]
        for r, x, y in zip(timed, lats, accs, strict=True):
            ax.errorbar(
                x, y, xerr=r.get("mu_lat_std", 0.0) * 1e3, yerr=r.get("mu_acc_std", 0.0),
                fmt="s" if r.get("kind") == "ar" else "o", capsize=2,
            )  # fmt: skip
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        xmax = max(lats) * 1.3
        ymax = max(accs) * 1.3
        rates = sorted(r["tok_s"] for r in timed)
        for rate in {rates[0], rates[len(rates) // 2], rates[-1]}:
            xs = [0.0, xmax]
            ax.plot(xs, [rate * x / 1e3 for x in xs], ":", color="gray", linewidth=0.8)
            x_label = min(xmax * 0.95, ymax * 1e3 / rate * 0.95)
            ax.text(x_label, rate * x_label / 1e3, f"{rate:.0f} tok/s", fontsize=6, color="gray")
        ax.set(xlim=(0, xmax), ylim=(0, ymax))
        ax.set_xlabel("mean latency per cycle mu_lat (ms)")
        ax.set_ylabel("tokens per cycle mu_acc (incl. correction)")
        ax.set_title("Acceptance vs latency (dotted: iso-throughput)")
        figures["tradeoff"] = fig
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = r.get("acceptance")
        if acc and r.get("kind") != "ar":
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["name"])
    ax.set(xlabel="window position", ylabel="acceptance rate", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    figures["acceptance"] = fig
    files: dict[str, str] = {}
    for name, fig in figures.items():
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=120)
        plt.close(fig)
        files[f"{name}_plot"] = str(out_dir / f"{name}.png")
    return files
