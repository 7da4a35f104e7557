"""Autoregressive decoding of the target with a KV cache: the STP baseline and the oracle.

Runs the target through the same split interface as the speculative decoder (trunk, then
the verifier tail with the LoRA adapter off, then the STP head) and the same layouts
(``mtpc.decoding.layout``: one stream, or many rows in one padded batch), so both decoders
see the same logits; speculative output is compared against this one token for token
(greedy) or in distribution (sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mtpc.decoding.common import GenerationResult, Request, emit
from mtpc.decoding.layout import Padded, Stream
from mtpc.decoding.loop import Layout, Row, Run, new_row, new_run


@torch.no_grad()
def autoregressive_generate(
    model: Any, prompts: Sequence[Tensor], requests: Sequence[Request], size: int = 1
) -> list[GenerationResult]:
    """One token per target pass for every row.

    Args:
        model: an ``MTPCModel`` (only the target path is used).
        prompts: ``(T_b,)`` ids on the model's device.
        requests: each prompt's checked arguments (``mtpc.decoding.common.check_request``).
        size: rows decoded at once (1: each prompt in the model's own caches).

    Returns:
        One :class:`GenerationResult` per prompt, one cycle per generated token.
    """
    if size == 1:
        return [_schedule(new_run(model, r, None), [p], [r], Stream(model), 1)[0]
                for p, r in zip(prompts, requests, strict=True)]  # fmt: skip
    return _schedule(new_run(model, requests[0], None), prompts, requests, Padded(model), size)


def _schedule(
    run: Run, prompts: Sequence[Tensor], requests: Sequence[Request], layout: Layout, size: int
) -> list[GenerationResult]:
    """Steps the rows until every prompt is done, ``size`` at most at once (a finished row's
    place goes to the next prompt)."""
    clock, rule = run.clock, run.rule
    results: list[GenerationResult | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    rows: list[Row] = []
    while waiting or rows:
        if waiting and len(rows) < size:
            take, waiting = waiting[: size - len(rows)], waiting[size - len(rows) :]
            new = [new_row(run, i, requests[i], prompts[i], "autoregressive") for i in take]
            logits = layout.admit(new, [prompts[i] for i in take])[1]  # (1, V) each
            seconds = clock.split()
            for row, last in zip(new, logits, strict=True):
                row.kept_logits, row.res.prefill_seconds = last, seconds / len(new)
            rows += new
        going, tokens = [], []
        for row in rows:
            token = rule.pick(row.kept_logits[0], row.generator)
            _, row.res.stopped = emit(
                row.res.tokens, [token], run.request, run.request.suppress_eos
            )
            if row.res.stopped or len(row.res.tokens) >= run.request.max_new_tokens:
                results[row.index] = row.res
            else:
                going.append(row)
                tokens.append(torch.tensor([token], device=row.kept_logits.device))
        clock.lap("verify")
        layout.release([row for row in rows if results[row.index] is not None])
        if going:
            for row, last in zip(
                going, layout.target(going, tokens, [None] * len(going))[1], strict=True
            ):
                row.kept_logits = last  # (1, V)
                row.res.trunk_passes += 1
        clock.lap("model")
        seconds = clock.split()
        clock.total += seconds
        for row in rows:  # each row's share of the batch's step
            row.res.cycle_seconds.append(seconds / len(rows))
        rows = going
    return [_finish(res, clock.breakdown(clock.total)) for res in results if res is not None]


def _finish(res: GenerationResult, breakdown: dict[str, float] | None) -> GenerationResult:
    """One step per token: no draft accepted, one token emitted."""
    steps = len(res.cycle_seconds)
    res.accepted, res.emitted = [0] * steps, [1] * steps
    res.drafted, res.offsets = [0] * steps, [0] * steps
    res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
    res.breakdown = breakdown
    return res
