"""Autoregressive decoding of the target with a KV cache: the STP baseline and the oracle.

Runs the target through the same split interface as the speculative decoder (trunk, then
the verifier tail with the LoRA adapter off, then the STP head), so both decoders see the
same logits; speculative output is compared against this one token for token (greedy) or in
distribution (sampling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, emit
from mtpc.decoding.loop import target_step


@torch.no_grad()
def autoregressive_generate(model: Any, prompt: Tensor, request: Request) -> GenerationResult:
    """One token per target pass.

    Args:
        model: an ``MTPCModel`` (only the target path is used).
        prompt: (1, T) ids on the model's device.
        request: checked arguments (``mtpc.decoding.common.check_request``).

    Returns:
        A :class:`GenerationResult` with one cycle per generated token.
    """
    device = model.backbone.device
    generator = torch.Generator(device=device).manual_seed(request.seed)
    rule = TargetRule.of(request, device)
    caches = model.new_caches()
    clock = Stopwatch(device, request.profile)

    logits = target_step(model, prompt, caches)[1][0]  # (V,)
    prefill = clock.split()

    out: list[int] = []
    res = GenerationResult(tokens=out, method="autoregressive", prefill_seconds=prefill)
    while True:
        token = rule.pick(logits, generator)
        clock.lap("verify")
        _, stopped = emit(out, [token], request, ignore_stops=request.suppress_eos)
        res.stopped = stopped
        if stopped or len(out) >= request.max_new_tokens:
            res.cycle_seconds.append(clock.split())
            break
        logits = target_step(model, torch.tensor([[token]], device=device), caches)[1][0]
        res.trunk_passes += 1
        clock.lap("model")
        res.cycle_seconds.append(clock.split())
    steps = len(res.cycle_seconds)
    res.accepted = [0] * steps
    res.emitted = [1] * steps
    res.drafted = [0] * steps
    res.offsets = [0] * steps
    res.seconds = prefill + sum(res.cycle_seconds)
    res.breakdown = clock.breakdown(sum(res.cycle_seconds))
    return res
