"""Autoregressive decoding of the target with a KV cache: the STP baseline and the oracle, as
``loop.decode``'s ``step`` (no proposer: one token per target pass; ``loop.prefill`` admits).

The same split (trunk, verifier tail with LoRA off, STP head) and layouts as the speculative
decoder, so both see the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtpc.decoding.draws import EMIT
from mtpc.decoding.loop import Layout, Outcome, Row, Run, cycle_draws, end_cycle, settle


def step(run: Run, layout: Layout, rows: Sequence[Row]) -> list[Row]:
    """One token of every row (the target's choice); returns the rows done."""
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
    run.clock.lap("verify")
    layout.release(done)
    if going:
        logits = layout.target(going, tokens, [None] * len(going))[1]
        for row, last in zip(going, logits, strict=True):
            row.kept_logits = last  # (1, V)
            row.res.trunk_passes += 1
    run.clock.lap("model")
    end_cycle(run, rows)
    return done
