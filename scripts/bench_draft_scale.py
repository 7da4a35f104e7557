"""The draft step at the paper's shapes, measured: the head's cost per cycle against the trunk's.

``scripts/head_bytes.py`` counts the weights a cycle reads on paper. This script times them:
it builds MTPC heads with random weights at the shapes of EvaByte-SFT and the byte Llama 3.2
3B (``head_bytes.TARGETS``: hidden size d, vocabulary V; n = 16, r = 32, FF r = 1), times one
draft step per family and mode (``mtpc.decoding.speculative.draft_step`` with a pending token,
what the ``condition`` policy drafts every cycle), and, as the trunk's reference, one decoder
layer of the target's shape (a transformers ``LlamaDecoderLayer``: the attention projections
and MLP of both targets; EvaByte's EVA attention differs in compute, not in weight bytes),
times the number of layers.

The draft's cost at these shapes is bytes of W and of the sum projections, so its share of
a cycle here is what an accelerator shows when both are memory-bound; on the tiny CPU target
(docs/BENCHMARKS.md) per-call overheads dominate instead.

    python scripts/bench_draft_scale.py                     # CPU, fp32: ~4 min, 6 GB
    python scripts/bench_draft_scale.py --device cuda --dtype bfloat16

Prints a markdown table per target: draft ms per family and mode, the draft's share of a
one-token trunk pass (memory-bound: what a verify pass costs where both are bytes; on this
CPU the n-token pass is compute-bound and slower, also printed), and the cycle's cost over
FF's ``(trunk + draft) / (trunk + FF draft)``.
``zsample1+q1`` and ``sample+q1`` add the marginal at the first draft, read when the first
acceptance test asks for it.
"""

from __future__ import annotations

import argparse
import gc
from functools import partial
from typing import Any

import torch
from benchlib import markdown_header, markdown_row, median_time
from head_bytes import TARGETS, head_rows

from mtpc.decoding.speculative import HeadState, draft_step
from mtpc.heads import MTPCHead

# the decoder layers of the targets in head_bytes.TARGETS:
# (layers, intermediate size, attention heads, key/value heads)
LAYERS = {
    "EvaByte-SFT (6.5 B)": (32, 11008, 32, 32),  # evabyte_hf/configuration_evabyte.py defaults
    "byte Llama 3.2 3B (2.82 B)": (28, 8192, 24, 8),  # Llama 3.2 3B config
}
V_UNUSED = 8  # a decoder layer has no embedding; LlamaConfig still asks for a vocabulary
HEADS = [("ff", 1), ("cp", 32), ("hmm", 32), ("btree", 32)]
MODES = [  # (label, draft mode, sampling, ask the first draft's q)
    ("greedy zmap", "zmap", False, False),
    ("greedy map", "map", False, False),
    ("zsample", "zsample", True, False),
    ("zsample1", "zsample1", True, False),
    ("zsample1+q1", "zsample1", True, True),
    ("sample+q1", "sample", True, True),
]


class HeadOnly(torch.nn.Module):
    """What a draft step reads of an ``MTPCModel``: its head; the state is the features."""

    def __init__(self, head: MTPCHead) -> None:
        super().__init__()
        self.head = head

    def draft_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def draft_params(self, hidden: torch.Tensor) -> Any:
        return self.head(hidden.reshape(-1, self.head.hidden_size))


def trunk_pass(
    name: str, d: int, n: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> tuple[float, float]:
    """Seconds of a trunk pass over 1 token and over n tokens: one decoder layer's, times the
    layers. One token is a memory-bound step (every weight read once), what a verify pass of
    n tokens costs on an accelerator; on a CPU the n-token pass is compute-bound."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    layers, inner, heads, kv_heads = LAYERS[name]
    config = LlamaConfig(
        hidden_size=d, intermediate_size=inner, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=V_UNUSED,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # a standalone layer gets no dispatch from a model
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device, dtype).eval()  # freed on return
    rotary = LlamaRotaryEmbedding(config).to(device)

    def seconds(tokens: int) -> float:
        x = torch.randn(1, tokens, d, device=device, dtype=dtype)
        cos_sin = rotary(x, torch.arange(tokens, device=device)[None])
        return median_time(lambda: layer(x, position_embeddings=cos_sin), repeats, device)[0]

    return seconds(1) * layers, seconds(n) * layers


def draft_seconds(
    kind: str,
    r: int,
    n: int,
    V: int,
    d: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> tuple[float, list[float]]:
    """(MB of W and R, seconds of one draft step per mode of :data:`MODES`) for a random head."""
    torch.manual_seed(0)
    model = HeadOnly(MTPCHead(kind, n, r, V, d).to(device, dtype).eval())
    hidden = torch.randn(1, d, device=device, dtype=dtype)
    pending = torch.tensor([[V // 2]], device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    W = model.head.unembedding
    megabytes = (W.numel() + head_rows(kind, n, r)[0] * d) * W.element_size() / 1e6

    def step(mode: str, sampling: bool, ask: bool) -> None:
        state = HeadState(model, hidden, 1.0 if sampling else None)
        draft = draft_step(state, pending, mode, generator, sampling=sampling)
        if ask:
            assert draft.proposal is not None
            draft.proposal(0)

    times = [median_time(partial(step, *mode[1:]), repeats, device)[0] for mode in MODES]
    return megabytes, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)"
    )
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    n = args.window
    print(
        f"device {device}, {dtype}, n = {n}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    for name, (_, d, V) in TARGETS.items():
        trunk, window = trunk_pass(name, d, n, device, dtype, args.repeats)
        print(
            f"\n### {name}: d = {d}, V = {V}; trunk pass over 1 token {trunk * 1e3:,.0f} ms "
            f"(the reference below), over {n} tokens {window * 1e3:,.0f} ms\n"
        )
        print(markdown_header("head", "W + sum proj. MB", *(m[0] for m in MODES)))
        ff: list[float] = []
        for kind, r in HEADS:
            megabytes, times = draft_seconds(kind, r, n, V, d, device, dtype, args.repeats)
            gc.collect()
            ff = ff or times
            cells = [
                f"{t * 1e3:,.1f} ms, {t / trunk:.2%}, x{(trunk + t) / (trunk + f):.3f}"
                for t, f in zip(times, ff, strict=True)
            ]
            print(markdown_row([f"{kind} r={r}", f"{megabytes:,.0f}", *cells]))
        print(
            "\nCells: draft step, its share of a one-token trunk pass, cycle (that pass + the "
            "draft) over FF's in the same mode."
        )


if __name__ == "__main__":
    main()
