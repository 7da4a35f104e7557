"""The real-code study's tables, from its evaluation folders (``scripts/run_study.sh report``).

    python scripts/study_table.py outputs/eval/code-study      # prints and writes STUDY.md

Reads the folders ``run_study.sh`` writes (no decoding): ``n8-s0-greedy`` ... (one per window,
seed and mode), ``n8-seeds-greedy`` ... (``eval.py report=[...]``: the seeds merged), ``lora-s0-*``
and ``selfdistill-s0-*``. Tokens per cycle are the evaluator's (mean ± std over prompt sets, or
over seeds); every Δ is a paired bootstrap over prompts (``mtpc.evaluation.statistics.compare``):
against FF in the grid, against the same family's k = 0 continued-training control for LoRA, and
against the same family trained on the original rows for self-distillation.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpc.evaluation.statistics import compare

MODES = ("greedy", "sampling")


def _load(folder: Path) -> tuple[dict[str, Any], dict[tuple[str | None, str], list[dict]]]:
    """A folder's results.json and its prompt records by (draft path, pass)."""
    results = json.loads((folder / "results.json").read_text())
    records: dict[tuple[str | None, str], list[dict]] = defaultdict(list)
    for line in (folder / "records.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "prompt":
            records[(rec.get("draft_path"), rec["pass"])].append(rec)
    return results, records


def _label(row: dict[str, Any]) -> str:
    kind = str(row["kind"]).upper().replace("BTREE", "BTree")
    return kind if row["kind"] == "ff" else f"{kind}, r = {row['rank']}"


def _interval(stats: dict[str, Any], key: str, fmt: str) -> str:
    value, low, high = stats[key], stats[f"{key}_low"], stats[f"{key}_high"]
    sign = "+" if key.startswith("delta") else ""
    return f"{value:{sign}{fmt}} [{low:{sign}{fmt}}, {high:{sign}{fmt}}]"


def _drafts(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["rows"] if r.get("pass") == "speculative"]


def _paired(
    root: Path,
    stem: str,
    vs: str,
    reference: Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any] | None],
    label: Callable[[dict[str, Any]], str],
    ratio: bool,
) -> list[str]:
    """The folders ``<stem>-<mode>``: each draft's tok/cyc, its paired Δ (and, with
    ``ratio``, its tok/s ratio) against ``reference(row, rows)`` (None: the row is a
    reference itself), and x AR; one line per draft, the modes side by side."""
    keys = ("delta_mu_acc", "ratio_tok_s") if ratio else ("delta_mu_acc",)
    columns = f"tok/cyc | Δ vs {vs} [95% CI]"
    columns += f" | x {vs} tok/s [95% CI] | x AR" if ratio else " | x AR"
    lines = ["| draft | " + " | ".join(f"{m} {columns}" for m in MODES) + " |"]
    lines.append("|---" * (1 + (2 + len(keys)) * len(MODES)) + "|")
    cells: dict[str, list[str]] = defaultdict(list)
    for mode in MODES:
        results, records = _load(root / f"{stem}-{mode}")
        ar = records[(None, "ar")]
        rows = _drafts(results)
        for row in rows:
            ref = reference(row, rows)
            stats = None
            if ref is not None:
                mine, theirs = (
                    records[(row["path"], "speculative")],
                    records[(ref["path"], "speculative")],
                )
                stats = compare(mine, theirs, ar)
            cells[label(row)] += [
                f"{row['mu_acc']:.2f} ± {row['mu_acc_std']:.2f}",
                *("-" if stats is None else _interval(stats, k, ".2f") for k in keys),
                f"{row['speedup_ar']:.2f}",
            ]
    return lines + [f"| {name} | " + " | ".join(c) + " |" for name, c in cells.items()]


def grid(root: Path, window: int) -> list[str]:
    """Seed 0, every family at one window: tok/cyc, Δ and x tok/s against FF, x AR."""

    def ff(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        return None if row["kind"] == "ff" else next(r for r in rows if r["kind"] == "ff")

    return _paired(root, f"n{window}-s0", "FF", ff, _label, ratio=True)


def seeds(root: Path) -> list[str]:
    """FF against BTree over the seeds: mean ± std over seeds of each seed's value."""
    head = "| draft | seeds | " + " | ".join(
        f"{m} tok/cyc | Δ vs FF | x FF tok/s | x AR" for m in MODES
    )
    lines = [head + " |", "|---" * (2 + 4 * len(MODES)) + "|"]
    for window in (8, 16):
        cells: dict[str, list[str]] = defaultdict(list)
        for mode in MODES:
            results = json.loads((root / f"n{window}-seeds-{mode}" / "results.json").read_text())
            for row in results["seeds"]:
                if row["pass"] != "speculative":
                    continue
                key = f"{row['name']} | {row['seeds']}"
                is_ff = row["name"].startswith("ff ")

                def ms(stat: str, fmt: str, row: dict[str, Any] = row) -> str:
                    return f"{row[stat]:{fmt}} ± {row[f'{stat}_std']:.2f}"

                cells[key] += [
                    ms("mu_acc", ".2f"),
                    "-" if is_ff else ms("delta_mu_acc", "+.2f"),
                    "-" if is_ff else ms("ratio_tok_s", ".2f"),
                    ms("speedup_ar", ".2f"),
                ]
        lines += [f"| {name} | " + " | ".join(c) + " |" for name, c in cells.items()]
    return lines


def against_own(root: Path, stem: str, control: dict[str, str]) -> list[str]:
    """Each draft against the named control of its own family (paired over prompts).

    ``control`` maps a run-name fragment to the fragment of its control's run name.
    """

    def own(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        names = {
            row["name"].replace(frag, base) for frag, base in control.items() if frag in row["name"]
        }
        return next((r for r in rows if r["name"] in names and r is not row), None)

    return _paired(root, stem, "control", own, lambda row: row["name"], ratio=False)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        raise SystemExit(2)
    root = Path(sys.argv[1])
    parts = []
    for window in (8, 16):
        parts += [f"### n = {window}, seed 0", "", *grid(root, window), ""]
    parts += ["### FF against BTree over seeds", "", *seeds(root), ""]
    parts += ["### LoRA (stage 2, n = 16; control: k = 0)", ""]
    parts += [*against_own(root, "lora-s0", {"-k1-": "-k0-"}), ""]
    parts += ["### Self-distillation (n = 8; control: the original rows)", ""]
    parts += [*against_own(root, "selfdistill-s0", {"regen_greedy": "heads", "regen_t1": "heads"})]
    text = "\n".join(parts) + "\n"
    (root / "STUDY.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
