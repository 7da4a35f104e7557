"""Cost of a self-speculative cycle in autoregressive steps: EvaByte vs a byte Llama (CPU).

A cycle that accepts every draft (``max_throughput=True``) is timed against one
autoregressive step of the same model in the same run (1 thread): ``cycle / AR step`` is the
cycle cost in AR steps. It is the speed-up ceiling's denominator: a cycle emits up to n
tokens, so SD beats AR only when the cost stays well under n.

* EvaByte: a tiny random model of the real remote code (``evabyte_hf/*.py`` of
  OpenEvaByte/evabyte, given as a directory; written as a hub checkpoint as
  ``scripts/check_remote_code.py`` does), 4 layers, d = 64, window_size 16, chunk_size 8,
  pure-torch EVA path.
* Byte Llama stand-in: a transformers ``LlamaForCausalLM`` of the same size (4 layers,
  d = 64, 4 heads, vocabulary 320, a ``DynamicCache``): the cache behaviour of the byte
  Llama, not its expansion embedding.

    python scripts/bench_cycle_cost.py <dir with evabyte_hf/*.py> [--new 96] [--repeats 3]

Prints JSON: per model and n in {4, 8, 16}, the AR step (ms), the cycle (ms), their ratio,
tokens per cycle and decoder-layer calls per cycle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from check_remote_code import write_checkpoint

from mtpc.backbones import load_backbone
from mtpc.decoding import generate
from mtpc.model import MTPCModel

WINDOWS = (4, 8, 16)


def byte_llama_stand_in() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def layer_calls(model: MTPCModel) -> tuple[list[int], list[Any]]:
    """A decoder-layer call counter ``[count]`` and the hook handles (remove them after)."""
    calls = [0]
    handles = [
        layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for layer in model.backbone.layers
    ]
    return calls, handles


def measure(make: Any, n: int, prompt: list[int], new: int, repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of the mean AR step and the mean all-accepting cycle."""
    model = make(n)
    calls, handles = layer_calls(model)  # the backbone is shared across windows
    ar_ms, sd_ms, tokens, per_cycle = [], [], [], []
    for _ in range(repeats):
        ar = generate(model, prompt, new, method="autoregressive", stop_ids=())
        ar_ms.append(1e3 * statistics.mean(ar.cycle_seconds))
        calls[0] = 0
        sd = generate(model, prompt, new, max_throughput=True, stop_ids=())
        cycles = len(sd.cycle_seconds)
        sd_ms.append(1e3 * statistics.mean(sd.cycle_seconds))
        tokens.append(sum(sd.emitted) / cycles)
        per_cycle.append(calls[0] / cycles)  # the prefill's calls included
    for handle in handles:
        handle.remove()
    ar_step, cycle = statistics.median(ar_ms), statistics.median(sd_ms)
    return {
        "ar_step_ms": round(ar_step, 3),
        "cycle_ms": round(cycle, 3),
        "cycle_in_ar_steps": round(cycle / ar_step, 2),
        "tokens_per_cycle": round(statistics.median(tokens), 2),
        "layer_calls_per_cycle": round(statistics.median(per_cycle), 2),
        "layers": float(model.backbone.num_layers),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "code", type=Path, help="the folder of EvaByte's remote *.py (a checkout's evabyte_hf/)"
    )
    parser.add_argument("--new", type=int, default=96, help="new ids per generation")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompt = list(range(70, 79))
    report: dict[str, Any] = {"threads": 1, "new": args.new, "prompt": len(prompt)}
    with tempfile.TemporaryDirectory() as tmp:
        folder, _ = write_checkpoint(
            "evabyte", args.code.resolve(), "default", Path(tmp),
            num_hidden_layers=4, window_size=16, chunk_size=8,
        )  # fmt: skip
        eva = load_backbone(
            "evabyte", path=str(folder), dtype="float32", device="cpu", attention_impl="torch"
        )
        llama = byte_llama_stand_in()
        for n in WINDOWS:
            report[f"evabyte n={n}"] = measure(
                lambda n: MTPCModel.from_backbone(eva, "cp", n, 2), n, prompt, args.new,
                args.repeats,
            )  # fmt: skip
            report[f"byte_llama n={n}"] = measure(
                lambda n: MTPCModel.from_hf(llama, "cp", n, 2), n, prompt, args.new, args.repeats
            )
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
