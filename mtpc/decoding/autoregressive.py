"""Autoregressive decoding of the target with a KV cache: the STP baseline and the oracle, as
``loop.decode``'s ``admit`` and ``step`` (no proposer: one token per target pass).

The same split (trunk, verifier tail with LoRA off, STP head) and layouts as the speculative
decoder, so both see the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtpc.decoding.common import Request
from mtpc.decoding.draws import EMIT
from mtpc.decoding.loop import Layout, Outcome, Row, Run, cycle_draws, new_row, settle


def prefill(run: Run, layout: Layout, new: Sequence[tuple[int, Request, Tensor]]) -> list[Row]:
    """Every prompt token of the new rows: keeps p(x_{T+1})."""
    rows = [new_row(run, i, request, prompt, "autoregressive") for i, request, prompt in new]
    logits = layout.admit(rows, [prompt for _, _, prompt in new])[1]  # (1, V) each
    seconds = run.clock.split()
    for row, last in zip(rows, logits, strict=True):  # each row's share of the admission
        row.kept_logits, row.res.prefill_seconds = last, seconds / len(rows)
    return rows


def step(run: Run, layout: Layout, rows: Sequence[Row]) -> list[Row]:
    """One token of every row (the target's choice); returns the rows done."""
    clock = run.clock
    kept = torch.cat([row.kept_logits for row in rows])  # (B, V)
    u = None if run.rule.greedy else cycle_draws(run, rows).take(EMIT, 1)[:, 0]  # (B,)
    chosen = run.rule.draw(kept, u)  # (B,): every row's token at once
    done, going, tokens = [], [], []
    for i, (row, token) in enumerate(zip(rows, chosen.tolist(), strict=True)):
        if settle(run, row, 0, Outcome([], token, drafted=0, keep=0, after=0)) is None:
            done.append(row)
        else:
            going.append(row)
            tokens.append(chosen[i : i + 1])  # (1,)
    clock.lap("verify")
    layout.release(done)
    if going:
        logits = layout.target(going, tokens, [None] * len(going))[1]
        for row, last in zip(going, logits, strict=True):
            row.kept_logits = last  # (1, V)
            row.res.trunk_passes += 1
    clock.lap("model")
    seconds = clock.split()
    clock.total += seconds
    for row in rows:  # each row's share of the batch's step
        row.res.cycle_seconds.append(seconds / len(rows))
    return done
