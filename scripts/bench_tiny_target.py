"""Autoregressive decoding speed of the tiny target (greedy, batch 1, KV cache) on this machine.

Exact command (repository root, inside the virtualenv)::

    python scripts/bench_tiny_target.py --new-tokens 256 --repeats 5 --threads 1

Three ways are timed, each after one warm-up run, reporting the median over ``--repeats``:
``model.generate`` (HF, KV cache), a manual loop over ``DynamicCache`` (the floor that our
own decoders pay per token), and a no-cache loop that re-reads the whole prefix every step.
End-of-turn ids are suppressed, so every run produces exactly ``--new-tokens`` bytes.
Also prints the model's size and the recorded validation bits per byte. Use one thread for
batch-1 decoding of a model this small: with two threads on two cores that other jobs also
use, OpenMP synchronisation made decoding 100x slower (4 vs 500 tokens/s) in our runs.
"""

from __future__ import annotations

import argparse
import json

import torch
from benchlib import median_time
from pretrain_tiny_target import tiny_generation_config
from transformers import DynamicCache, LlamaForCausalLM

from mtpc.backbones.tiny import TINY_TARGET_DIR, load_tiny_target

PROMPT = [{"role": "user", "content": "Write a Python function that returns the square of x."}]


@torch.no_grad()
def generate_hf(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    config = tiny_generation_config()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    return model.generate(prompt, generation_config=config)[:, prompt.shape[1] :]  # (1, N)


@torch.no_grad()
def generate_kv_loop(
    model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int, use_cache: bool = True
) -> torch.Tensor:
    """Greedy decoding one token per forward pass; stop ids are masked out."""
    stop = torch.tensor(tiny_generation_config().eos_token_id)
    cache = DynamicCache(config=model.config) if use_cache else None
    ids, out = prompt, []  # ids: (1, T)
    feed = prompt
    for _ in range(new_tokens):
        logits = model(input_ids=feed, past_key_values=cache, use_cache=use_cache).logits[:, -1]
        logits[:, stop] = float("-inf")  # (1, V)
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        out.append(token)
        ids = torch.cat([ids, token], dim=1)
        feed = token if use_cache else ids
    return torch.cat(out, dim=1)  # (1, N)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache-tokens", type=int, default=256, help="0 skips the no-cache loop")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = load_tiny_target()
    model, codec = target.model, target.codec
    prompt = torch.tensor([codec.generation_prompt(PROMPT)])  # (1, T)
    n = args.new_tokens
    results: dict[str, float | int | str] = {
        "threads": args.threads,
        "prompt_tokens": prompt.shape[1],
        "new_tokens": n,
        "parameters": sum(p.numel() for p in model.parameters()),
        "mtp_parameters": target.mtp_unembeddings.numel(),
        "asset_bytes": sum(f.stat().st_size for f in TINY_TARGET_DIR.iterdir()),
        "validation_bits_per_byte": target.metadata["validation"]["bits_per_byte"],
        "validation_assistant_bits_per_byte": target.metadata["validation"][
            "assistant_bits_per_byte"
        ],
    }
    seconds, hf = median_time(lambda: generate_hf(model, prompt, n), args.repeats)
    results["generate_tokens_per_s"] = n / seconds
    seconds, loop = median_time(lambda: generate_kv_loop(model, prompt, n), args.repeats)
    results["kv_loop_tokens_per_s"] = n / seconds
    results["generate_equals_kv_loop"] = str(torch.equal(hf, loop))
    if args.no_cache_tokens:
        m = args.no_cache_tokens
        seconds, _ = median_time(lambda: generate_kv_loop(model, prompt, m, use_cache=False), 1)
        results["no_cache_tokens_per_s"] = m / seconds
    print(json.dumps(results, indent=2))
    print("greedy answer:", repr(codec.decode(loop[0])[:80]))


if __name__ == "__main__":
    main()
