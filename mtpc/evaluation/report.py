"""Reports of an evaluation: stdout table, results.json, CSV, and plots (matplotlib Agg).

Plots: accepted tokens per cycle vs latency with iso-throughput lines across every draft of
one call (paper Fig. 1), and acceptance per window position.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("name", "draft", "{}"),
    ("kind", "kind", "{}"),
    ("window", "n", "{}"),
    ("rank", "r", "{}"),
    ("lora_layers", "k", "{}"),
    ("mu_lat", "mu_lat ms", "ms"),
    ("mu_acc", "mu_acc tok/cyc", "2f"),
    ("mu_acc_drafts", "acc drafts", "2f"),
    ("tok_s", "tok/s", "1f"),
    ("max_tok_s", "max tok/s", "1f"),
    ("speedup_ar", "x AR", "2f"),
    ("speedup_baseline", "x baseline", "2f"),
    ("peak_memory_mb", "peak MB", "0f"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "{}":
        return str(value)
    std = row.get(f"{key}_std")
    scale, spec = (1e3, ".3f") if fmt == "ms" else (1.0, f".{fmt}")
    text = format(value * scale, spec)
    if std is not None and not math.isnan(std) and key != "peak_memory_mb":
        text += " ± " + format(std * scale, spec)
    return text


def format_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """A markdown table (mean ± std over prompt sets)."""
    header = [label for _, label, _ in COLUMNS]
    body = [[_cell(r, key, fmt) for key, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = [title] if title else []
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) + " |")
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> dict[str, str]:
    """results.json, results.csv and the plots; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out_dir / "results.json"), "csv": str(out_dir / "results.csv")}
    Path(files["json"]).write_text(json.dumps(results, indent=2, default=str) + "\n")
    rows = results["rows"]
    keys = sorted({k for r in rows for k, v in r.items() if not isinstance(v, list | dict)})
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in keys})
    if plots:
        files.update(plot_tradeoff(rows, out_dir / "tradeoff.png"))
        files.update(plot_acceptance(rows, out_dir / "acceptance.png"))
    return files


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path) -> dict[str, str]:
    """Tokens per cycle vs latency, iso-throughput lines (paper Fig. 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    lats = [r["mu_lat"] * 1e3 for r in rows]
    accs = [r["mu_acc"] for r in rows]
    for r, x, y in zip(rows, lats, accs, strict=True):
        ax.errorbar(
            x,
            y,
            xerr=r.get("mu_lat_std", 0.0) * 1e3,
            yerr=r.get("mu_acc_std", 0.0),
            fmt="s" if r.get("kind") == "ar" else "o",
            capsize=2,
        )
        ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    xmax = max(lats) * 1.3
    ymax = max(accs) * 1.3
    rates = sorted(r["tok_s"] for r in rows)
    for rate in {rates[0], rates[len(rates) // 2], rates[-1]}:
        xs = [0.0, xmax]
        ax.plot(xs, [rate * x / 1e3 for x in xs], ":", color="gray", linewidth=0.8)
        x_label = min(xmax * 0.95, ymax * 1e3 / rate * 0.95)
        ax.text(x_label, rate * x_label / 1e3, f"{rate:.0f} tok/s", fontsize=6, color="gray")
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("mean latency per cycle mu_lat (ms)")
    ax.set_ylabel("tokens per cycle mu_acc (incl. correction)")
    ax.set_title("Acceptance vs latency (dotted: iso-throughput)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"tradeoff_plot": str(path)}


def plot_acceptance(rows: Sequence[dict[str, Any]], path: Path) -> dict[str, str]:
    """Acceptance rate per window position, one line per draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = r.get("acceptance")
        if not acc or r.get("kind") == "ar":
            continue
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["name"])
    ax.set_xlabel("window position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"acceptance_plot": str(path)}
