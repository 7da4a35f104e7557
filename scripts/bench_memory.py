"""Memory of draft + verifier for k = 0, 1, 2, 4 relative to the bare target (paper Fig. 5).

Each k runs in a fresh subprocess so peak RSS is not shared between measurements:

    python scripts/bench_memory.py                                   # tiny-shaped, CPU
    python scripts/bench_memory.py --device cuda --preset evabyte-shaped   # GPU, 32 x 4096

Reports parameters and bytes held (target, head, LoRA) and the peak memory delta over the
bare target (CPU: peak RSS from ``resource.getrusage``; CUDA: ``torch.cuda.max_memory_allocated``).
Random weights, a LlamaForCausalLM of the preset's shape; the head is CP with the given n, r.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchlib import markdown_header, markdown_row

PRESETS = {
    # the tiny target's shape (assets/tiny_target is a small LlamaForCausalLM, V = 320)
    "tiny-shaped": {"hidden": 256, "layers": 8, "heads": 8, "inter": 688, "vocab": 320},
    # EvaByte-SFT's shape: 32 layers, d = 4096, V = 320 (Llama attention stands in for EVA)
    "evabyte-shaped": {"hidden": 4096, "layers": 32, "heads": 32, "inter": 11008, "vocab": 320},
}


def _peak(device: str) -> int:
    from mtpc.evaluation.run import peak_memory_mb  # here: the parent stays light (benchlib)

    return int(peak_memory_mb(device) * 2**20)


def measure(
    preset: str, k: int, device: str, dtype: str, window: int, rank: int, lora_rank: int
) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpc.backbones import resolve_dtype
    from mtpc.model import MTPCModel

    torch_dtype = resolve_dtype(dtype, device)
    p = PRESETS[preset]
    config = LlamaConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["heads"],
    )  # fmt: skip
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(torch_dtype).eval()
    ids = torch.randint(64, p["vocab"], (1, 256), device=device)
    with torch.no_grad():
        hf(input_ids=ids)  # bare target forward: the baseline
    base_peak = _peak(device)
    target_params = sum(t.numel() for t in hf.parameters())
    target_bytes = sum(t.numel() * t.element_size() for t in hf.parameters())
    out: dict = {"preset": preset, "device": device, "dtype": dtype, "k": k}
    if k >= 0:
        model = MTPCModel.from_hf(
            hf,
            kind="cp",
            window=window,
            rank=rank,
            lora_layers=k,
            lora_rank=lora_rank,
            head_dtype=dtype,
        )
        with torch.no_grad():
            caches = model.new_caches()
            h = model.trunk(ids, caches.trunk)
            model.verifier_logits(model.verifier_tail(h, caches.verifier)[:, -1:])
            model.draft_params(model.draft_tail(h, caches.draft)[:, -1:])
        head_params = sum(t.numel() for t in model.head.parameters())
        head_bytes = sum(t.numel() * t.element_size() for t in model.head.parameters())
        lora = model.backbone.lora.parameters() if model.backbone.lora else []
        lora_params = sum(t.numel() for t in lora)
        lora_bytes = sum(t.numel() * t.element_size() for t in lora)
        layer_bytes = sum(
            t.numel() * t.element_size()
            for n, t in hf.model.layers[0].named_parameters()
            if "lora_" not in n
        )
        out.update(
            target_params=target_params, target_bytes=target_bytes, head_params=head_params,
            head_bytes=head_bytes, lora_params=lora_params, lora_bytes=lora_bytes,
            held_ratio=(target_bytes + head_bytes + lora_bytes) / target_bytes,
            one_layer_bytes=layer_bytes,
            peak_delta_bytes=_peak(device) - base_peak, base_peak_bytes=base_peak,
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-shaped")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--ks", default="0,1,2,4")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.one is not None:
        options = (args.device, dtype, args.window, args.rank, args.lora_rank)
        print(json.dumps(measure(args.preset, args.one, *options)))
        return
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--device", args.device, "--dtype", dtype,
               "--window", str(args.window), "--rank", str(args.rank), "--lora-rank", str(args.lora_rank),
               "--one", str(k)]  # fmt: skip
        rows.append(
            json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        )
    mib = 2**20
    print(f"preset={args.preset} device={args.device} dtype={dtype} head=cp n={args.window} r={args.rank} "
          f"lora_rank={args.lora_rank}")  # fmt: skip
    print(f"target: {rows[0]['target_params']:,} params, {rows[0]['target_bytes'] / mib:.1f} MiB; "
          f"one layer {rows[0]['one_layer_bytes'] / mib:.2f} MiB")  # fmt: skip
    print(markdown_header("k", "head MiB", "LoRA params", "LoRA MiB", "held / target",
                          "peak delta MiB", "peak delta / layer"))  # fmt: skip
    for r in rows:
        print(markdown_row([
            r["k"], f"{r['head_bytes'] / mib:.2f}", f"{r['lora_params']:,}",
            f"{r['lora_bytes'] / mib:.3f}", f"{r['held_ratio']:.4f}",
            f"{r['peak_delta_bytes'] / mib:.1f}", f"{r['peak_delta_bytes'] / r['one_layer_bytes']:.2f}",
        ]))  # fmt: skip


if __name__ == "__main__":
    main()
