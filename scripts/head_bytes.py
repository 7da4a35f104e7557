"""Bytes of weights read per decoding cycle by the MTPC head and by the trunk, on paper.

Batch-1 decoding is memory-bound: a cycle reads every weight it uses once. The trunk reads
its parameters once per verify pass (KV cache and activations not counted); the head reads
the sum-unit projections R (every sum unit, every cycle) and rows of W (n, r, V, d): all
n·r rows for the full-table drafts (``draft=map``, ``draft=chain``), r rows at the pending
token's position plus one per drafted position for ``draft=path`` (ff: n - 1; a marginal
proposal reads more, only where a test asks). The choices: docs/DECODING.md, "Drafting".
Counts come from the real structures (``build_structure``).

    python scripts/head_bytes.py            # EvaByte-SFT and the byte Llama 3.2 3B, bf16
"""

from __future__ import annotations

from mtpc.circuits import build_structure

# name: (trunk parameters, hidden size d, vocabulary V); bf16 = 2 bytes per weight
TARGETS = {
    "EvaByte-SFT (6.5 B)": (6.5e9, 4096, 320),
    # Llama 3.2 3B without its 128k-token embeddings: 28 x 100.7 M + 2 x 265 x 3072
    "byte Llama 3.2 3B (2.82 B)": (2.82e9, 3072, 265),
}
HEADS = [("ff", 16, 1), ("cp", 16, 32), ("hmm", 16, 32), ("btree", 16, 32), ("btree", 8, 32)]


def head_rows(kind: str, n: int, r: int) -> tuple[int, int, int]:
    """(sum-projection rows of length d, W rows today, W rows with a latent-path draft)."""
    s = build_structure(kind, n, r)
    full = n * r
    path = (n - 1) + (r if r > 1 else 0)  # pending token: its r leaves, then one per draft
    return int(s.param_contextual.sum()) * r, full, path


def main() -> None:
    print(
        "| target | head | trunk MB | sum proj. MB | W today MB | head today / trunk | W new MB | head new / trunk |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (params, d, V) in TARGETS.items():
        trunk = 2 * params / 1e6
        for kind, n, r in HEADS:
            proj_rows, full, path = head_rows(kind, n, r)
            proj = 2 * proj_rows * d / 1e6
            today, new = 2 * full * V * d / 1e6, 2 * path * V * d / 1e6
            print(
                f"| {name} | {kind} n={n} r={r} | {trunk:,.0f} | {proj:,.1f} | {today:,.1f} | "
                f"{(proj + today) / trunk:.1%} | {new:,.1f} | {(proj + new) / trunk:.1%} |"
            )


if __name__ == "__main__":
    main()
