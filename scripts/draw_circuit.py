"""Draw a circuit structure to an image.

    python scripts/draw_circuit.py --kind btree --window 8 --rank 4 --out btree.png

Uses cirkit's graphviz renderer (``to_cirkit`` + ``cirkit.symbolic.io.plot_circuit``) when the
graphviz ``dot`` binary is installed; otherwise falls back to a matplotlib drawing of the
folded layers (one box per fold: inputs per window position, products, sums with their
number of units) and says so.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from mtpc.circuits import build_structure
from mtpc.circuits.structure import Structure


def draw_with_cirkit(structure: Structure, out: Path) -> None:
    """Render through cirkit + graphviz (needs the ``dot`` binary)."""
    from cirkit.symbolic.io import plot_circuit

    from mtpc.circuits.cirkit_bridge import to_cirkit

    sc = to_cirkit(structure, vocab_size=2)
    graph = plot_circuit(sc)
    graph.format = out.suffix.lstrip(".") or "png"
    graph.render(str(out.with_suffix("")), cleanup=True)


def draw_with_matplotlib(structure: Structure, out: Path) -> None:
    """Layered drawing of the folds (no graphviz needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = structure.layers
    pos: dict[tuple[int, int], tuple[float, float]] = {}
    for lid, la in enumerate(layers):
        for f in range(la.num_folds):
            if la.kind == "input":
                x = float(la.scopes[f][0])
            else:
                x = sum(la.scopes[f]) / len(la.scopes[f])
            pos[(lid, f)] = (x, float(lid))
    width = max(4.0, structure.window * 0.9)
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.8 * len(layers)))
    colors = {"input": "#ffbd2a", "product": "#24a5af", "sum": "#607d8b"}
    for lid, la in enumerate(layers):
        for slot in la.slots:  # fold f's child: fold index[f] of the sources' concatenation
            folds = [(src, c) for src in slot.sources for c in range(layers[src].num_folds)]
            for f, k in enumerate(slot.index.tolist()):
                (x0, y0), (x1, y1) = pos[(lid, f)], pos[folds[k]]
                ax.plot([x0, x1], [y0, y1], color="#999999", lw=1, zorder=1)
        for f in range(la.num_folds):
            x, y = pos[(lid, f)]
            label = {"input": f"x{la.scopes[f][0] + 1}", "product": "⊙", "sum": "+"}[la.kind]
            if la.kind != "product":
                label += f"\n{la.num_units}"
            ax.text(
                x,
                y,
                label,
                ha="center",
                va="center",
                color="white",
                fontsize=9,
                zorder=2,
                bbox={"boxstyle": "round", "fc": colors[la.kind], "ec": "none"},
            )
    ax.set_xlim(-0.8, structure.window - 0.2)
    ax.set_ylim(-0.7, len(layers) - 0.3)
    ax.axis("off")
    ax.set_title(f"{structure.kind}: n={structure.window}, r={structure.rank} (units per box)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kind", default="btree", choices=["ff", "cp", "hmm", "btree"])
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--rank", type=int, default=None, help="default: 1 for ff, 4 otherwise")
    ap.add_argument("--out", default=None, help="image path (default: <kind>_n<window>.png)")
    ap.add_argument("--backend", choices=["auto", "cirkit", "matplotlib"], default="auto")
    args = ap.parse_args()
    rank = args.rank if args.rank is not None else (1 if args.kind == "ff" else 4)
    structure = build_structure(args.kind, args.window, rank)
    out = Path(args.out or f"{args.kind}_n{args.window}.png")
    backend = args.backend
    if backend == "auto":
        backend = "cirkit" if shutil.which("dot") else "matplotlib"
        if backend == "matplotlib":
            print("graphviz 'dot' binary not found: drawing the folded layers with matplotlib")
    if backend == "cirkit":
        draw_with_cirkit(structure, out)
    else:
        draw_with_matplotlib(structure, out)
    print(f"wrote {out} ({structure})")


if __name__ == "__main__":
    main()
