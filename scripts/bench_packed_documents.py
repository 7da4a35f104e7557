"""How much packed training rows leak across documents, and what one document per row costs.

Builds the real-code conformance EvaByte checkpoint of ``scripts/check_remote_code.py`` (a tiny
random model of EvaByte's own remote code: window 16, chunk 4, 3 layers), loads it through
``load_backbone`` (pure-torch EVA) and runs every layer the way training does
(``run_layers(..., positions=restarting, documents=...)``):

* document B alone (positions 0..|B|-1), and
* the packed row [A; B] with B's positions restarting at 0 and ``documents`` marking A and B,

then compares B's final features (normed hidden states, what the MTPC head reads) and
next-byte logits. The bundled tiny target (Llama, block-diagonal mask) is the control: there
packing must change nothing. The padding cost of one document per row is the fill ratio of
the synthetic corpus's training split (EvaByte codec) packed best-fit vs one per row, padded to
``seq_len`` or cut per batch to its longest row (``collate_trimmed``, random batches).

    python scripts/bench_packed_documents.py <dir with evabyte_hf/*.py> [--rows 2000]

Prints JSON (docs/TRAINING.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from check_remote_code import write_checkpoint

from mtpc.backbones import load_backbone
from mtpc.data.packing import plan_packing


@torch.no_grad()
def features(backbone: Any, ids: torch.Tensor, positions: torch.Tensor, documents: Any) -> Any:
    """Final features (1, T, d) and STP logits (1, T, V) of a cache-free run of every layer."""
    hidden = backbone.embed(ids)
    hidden = backbone.run_layers(
        hidden, 0, backbone.num_layers, positions, None, adapter=False, documents=documents
    )
    feats = backbone.norm(hidden)
    return feats, backbone.stp_logits(feats)


def leak(backbone: Any, len_a: int, len_b: int, seed: int = 0) -> dict[str, float]:
    """B's features and logits alone vs after A in one packed row."""
    g = torch.Generator().manual_seed(seed)
    low, high = 3, min(backbone.vocab_size, 259)  # byte ids of the codecs' byte range
    a = torch.randint(low, high, (1, len_a), generator=g)
    b = torch.randint(low, high, (1, len_b), generator=g)
    alone_f, alone_l = features(
        backbone, b, torch.arange(len_b)[None], torch.zeros(1, len_b, dtype=torch.long)
    )
    row = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(len_a), torch.arange(len_b)])[None]
    documents = torch.cat([torch.zeros(len_a), torch.ones(len_b)]).long()[None]
    packed_f, packed_l = features(backbone, row, positions, documents)
    packed_f, packed_l = packed_f[:, len_a:], packed_l[:, len_a:]
    rel = (packed_f - alone_f).norm(dim=-1) / alone_f.norm(dim=-1)  # (1, |B|)
    p, q = alone_l.log_softmax(-1), packed_l.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)  # (1, |B|) KL(alone || packed) per position
    return {
        "len_a": len_a,
        "len_b": len_b,
        "feature_rel_diff_max": float(rel.max()),
        "feature_rel_diff_mean": float(rel.mean()),
        "feature_rel_diff_last": float(rel[0, -1]),
        "logit_abs_diff_max": float((packed_l - alone_l).abs().max()),
        "kl_mean": float(kl.mean()),
        "argmax_agreement": float((packed_l.argmax(-1) == alone_l.argmax(-1)).float().mean()),
    }


def padding_cost(rows: int, seq_lens: tuple[int, ...]) -> list[dict[str, float]]:
    """Fill ratio of best-fit packing vs one document per row (synthetic corpus, EvaByte codec)."""
    from mtpc.data.datamodule import build_datamodule

    with tempfile.TemporaryDirectory() as cache:
        dm = build_datamodule(source="synthetic", codec="evabyte", num_rows=rows, cache_dir=cache)
        lengths = dm._ensure_prepared().doc_lengths("train")
    out = []
    for seq_len in seq_lens:
        packed, single = plan_packing(lengths, seq_len), plan_packing(lengths, seq_len, False)
        pieces = single.seg_len  # (rows,) one document (or piece) per row
        trimmed = {}
        for batch in (1, 4, 16):  # batches cut to their longest row (collate_trimmed)
            order = np.random.default_rng(0).permutation(len(pieces))
            cut = len(order) // batch * batch
            longest = pieces[order[:cut]].reshape(-1, batch).max(axis=1)
            trimmed[f"trimmed_fill_b{batch}"] = float(
                pieces[order[:cut]].sum() / (longest.sum() * batch)
            )
        out.append(
            {
                **trimmed,
                "seq_len": seq_len,
                "documents": len(lengths),
                "mean_length": float(lengths.mean()),
                "packed_rows": packed.num_sequences,
                "packed_fill": packed.fill_ratio(),
                "single_rows": single.num_sequences,
                "single_fill": single.fill_ratio(),
                "compute_ratio": single.num_sequences / packed.num_sequences,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "code", type=Path, help="the folder of EvaByte's remote *.py (a checkout's evabyte_hf/)"
    )
    parser.add_argument("--rows", type=int, default=2000, help="synthetic rows for the padding")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        folder, _ = write_checkpoint("evabyte", args.code.resolve(), "default", Path(root))
        eva = load_backbone("evabyte", path=str(folder), dtype="float32", attention_impl="torch")
        pairs = ((5, 40), (16, 40), (37, 40), (64, 60))  # across EVA's chunk (4) and window (16)
        report["evabyte"] = [leak(eva, a, b) for a, b in pairs]
    tiny = load_backbone("tiny")
    report["tiny_control"] = [leak(tiny, a, b) for a, b in pairs]
    report["padding"] = padding_cost(args.rows, (2048, 8192))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
