"""Exactly lossless self-speculative decoding with a circuit draft: the chain (paper Sec. 3.4):
what a chain drafts (:func:`draft_step`) and how it is verified; the loop is
``mtpc.decoding.loop``'s. See docs/DECODING.md, "Drafting" and "The draft step".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mtpc.circuits.engine import categorical
from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import Request
from mtpc.decoding.loop import HeadState, Outcome, Proposal, Row, Run
from mtpc.decoding.settings import DraftRule
from mtpc.decoding.verify import verify_greedy, verify_sampling_lazy

Drafter = Callable[[CircuitParams, Tensor | None, int], Tensor]
"""Test hook: ``(params, evidence (1, m) or None, position) -> window (1, n)``, where
``position`` is the index (among prompt + generated ids) of the window's first token."""


@dataclass
class Draft:
    """A drafted window and what verifying it needs (both None when greedy)."""

    window: Tensor  # (1, n): the evidence (the pending token, if any), then the m drafts
    token_probs: Tensor | Callable[[int], float] | None = None  # (m,) q_i(x_i), or i -> q_i(x_i)
    proposal: Callable[[int], Tensor] | None = None  # i -> (V,) q_i(.), at the first rejection


class MarginalProposal:
    """The circuit's exact conditionals q(x_i | x_<i) of a drafted ``window`` ``(1, n)`` (``pre``
    evidence positions, then the drafts), computed lazily: q_i reads every unit's leaf at the
    positions up to i, only when a test asks for it. ``rows`` ``(1, k, r, V)``: normalised
    leaves of the first k positions if already read.
    """

    def __init__(self, state: HeadState, window: Tensor, pre: int, rows: Tensor | None = None):
        self.state, self.window, self.pre, self.rows = state, window, pre, rows

    def _leaves(self, upto: int) -> tuple[Tensor, Tensor]:
        """Every unit at positions <= upto ``(1, upto + 1, r, V)`` and their values at the
        window's tokens ``(1, upto + 1, r)``."""
        k = 0 if self.rows is None else self.rows.shape[1]
        if k <= upto:
            new = self.state.leaf_logp(torch.arange(k, upto + 1))  # (1, upto + 1 - k, r, V)
            self.rows = new if self.rows is None else torch.cat([self.rows, new], 1)
        assert self.rows is not None
        rows = self.rows[:, : upto + 1]
        x = self.window[:, : upto + 1, None, None].expand(-1, -1, rows.shape[2], 1)
        return rows, rows.gather(3, x).squeeze(3)

    def token_prob(self, i: int) -> float:
        """q(x_{pre+i} | x_<pre+i) at the drafted token."""
        j = self.pre + i
        circuit = self.state.circuit
        _, leaves = self._leaves(j)  # (1, j + 1, r)
        leaves = torch.cat(
            [leaves, leaves.new_zeros(1, circuit.window - j - 1, leaves.shape[2])], 1
        )
        prefix = circuit.prefix_from_leaves(leaves, self.state.sum_logw())[0]  # (n,)
        return float((prefix[j] - prefix[j - 1]).exp() if j else prefix[0].exp())

    def dist(self, i: int) -> Tensor:
        """q(. | x_<pre+i) ``(V,)``: the full conditional (the residual at a rejection)."""
        j = self.pre + i
        rows, leaves = self._leaves(j)
        lw = self.state.sum_logw()
        return self.state.circuit.conditional_from_leaves(leaves[:, :j], rows[:, j], lw)[0].exp()

    def draft(self) -> Draft:
        """The window with this proposal."""
        return Draft(self.window, self.token_prob, self.dist)


def draft_step(
    state: HeadState,
    evidence: Tensor | None,
    mode: str,
    generator: torch.Generator | None,
    *,
    sampling: bool,
) -> Draft:
    """One draft from ``state``: the window and, when ``sampling``, the proposal verification
    needs. ``evidence``: ``(1, pre)`` the pending token, or None; ``mode``: a ``DraftRule``
    value (sampling needs ``sample``, ``zsample`` or ``zsample1``)."""
    circuit = state.circuit
    n = circuit.window
    pre = 0 if evidence is None else evidence.shape[1]
    if pre == n:  # nothing to draft (n = 1 with a pending token)
        assert evidence is not None
        empty = torch.zeros(0, device=evidence.device)
        return Draft(evidence, empty, empty.__getitem__) if sampling else Draft(evidence)
    if mode in ("map", "chain"):  # the whole (1, n, r, V) table: max-product or greedy chain
        decode = circuit.map_decode if mode == "map" else circuit.greedy_chain
        return Draft(decode(state.params(), evidence=evidence))
    rows = evidence_leaves = None
    if evidence is not None and circuit.rank > 1 and mode == "zmap":
        # greedy: each unit's logit at the pending token, no normalisers (r d-vectors of W,
        # not r rows); any draft is exact when greedy (docs/DECODING.md, "Drafting")
        evidence_leaves = state.token_logits(evidence)  # (1, pre, r)
    elif evidence is not None and circuit.rank > 1:  # r = 1: one path, the evidence is moot
        rows = state.leaf_logp(torch.arange(pre))  # (1, pre, r, V): every unit, evidence only
        evidence_leaves = rows[0, torch.arange(pre, device=rows.device), :, evidence[0]][None]
    if circuit.rank == 1:  # one unit per position: the only path
        units = torch.zeros(n - pre, dtype=torch.long)
    else:
        path = circuit.latent_path(
            state.sum_logw(), evidence_leaves, most_probable=mode == "zmap", generator=generator
        )  # (1, n)
        units = path[0, pre:]
    positions = torch.arange(pre, n)
    if mode == "zmap":  # the argmax needs no normaliser
        tokens = state.leaf_logits(positions, units)[0].argmax(-1)  # (m,)
        return Draft(tokens[None] if evidence is None else torch.cat([evidence, tokens[None]], 1))
    logp = state.leaf_logp(positions, units)[0]  # (m, V)
    tokens = categorical(logp, generator)  # with z, an ancestral sample
    probs = logp.exp()  # (m, V): q_i(. | z), independent of the earlier drafts given z
    window = tokens[None] if evidence is None else torch.cat([evidence, tokens[None]], 1)
    if not sampling:
        return Draft(window)
    if mode == "sample" and circuit.rank > 1:  # r = 1: q(. | z) is the marginal
        return MarginalProposal(state, window, pre, rows).draft()
    if mode == "zsample1" and circuit.rank > 1:
        # x_1 against the marginal q(. | evidence) (lazily), the later drafts against q(. | z):
        # exact, as (z, x_1) is an ancestral draw (docs/DECODING.md, "The draft step")
        first = FirstMarginal(MarginalProposal(state, window, pre, rows), probs, tokens)
        return Draft(window, first.token_prob, first.dist)
    return Draft(window, probs.gather(1, tokens[:, None])[:, 0], probs.__getitem__)


class FirstMarginal:
    """``zsample1``'s proposal: the ``marginal`` q(. | evidence) at the first draft (computed on
    demand), then ``probs`` ``(m, V)`` q(. | z) at the later ``tokens`` ``(m,)``."""

    def __init__(self, marginal: MarginalProposal, probs: Tensor, tokens: Tensor) -> None:
        self.marginal, self.probs, self.tokens = marginal, probs, tokens
        self._first: Tensor | None = None

    def token_prob(self, i: int) -> float:
        """q_i at the i-th draft."""
        return float(self.dist(0)[self.tokens[0]] if i == 0 else self.probs[i, self.tokens[i]])

    def dist(self, i: int) -> Tensor:
        """The full proposal q_i(.) ``(V,)`` (the residual at a rejection)."""
        if i:
            return self.probs[i]
        if self._first is None:
            self._first = self.marginal.dist(0)  # (V,): every unit at the first draft
        return self._first


def zmap_rows(states: Sequence[HeadState], evidence: Sequence[Tensor | None]) -> list[Tensor]:
    """The greedy latent-path draft (``zmap``, :func:`draft_step`) of B rows in one pass over
    the head (W's rows read once for all rows); ``evidence``: each row's pending token
    ``(1, 1)``, all None or none. Returns each row's window ``(1, n)``."""
    head, circuit = states[0].head, states[0].circuit
    n, r = circuit.window, circuit.rank
    pre = 0 if evidence[0] is None else 1
    e = torch.cat([s.features for s in states])  # (B, d)
    w = head.unembedding  # (n, r, V, d)
    if pre == n:  # nothing to draft (n = 1 with a pending token)
        return [ev for ev in evidence if ev is not None]
    logits = head.input_logits(e, list(range(pre, n)))  # (B, m, r, V); W's rows: a view
    if r == 1:  # one unit per position: the only path
        tokens = logits[:, :, 0].float().argmax(-1)  # (B, m)
    else:
        leaves = None
        if pre:  # each unit's logit at the pending token, no normaliser (as draft_step)
            pending = torch.cat([ev[0] for ev in evidence if ev is not None])  # (B,)
            rows = w[0][:, pending].transpose(0, 1)  # (B, r, d)
            leaves = torch.einsum("bd,brd->br", e.to(w.dtype), rows).float()[:, None]
        path = circuit.latent_path(head.sum_log_weights(e), leaves, most_probable=True)
        units = path[:, pre:, None, None].expand(-1, -1, 1, logits.shape[-1])
        tokens = logits.gather(2, units)[:, :, 0].float().argmax(-1)  # (B, m)
    return [
        tokens[b : b + 1] if ev is None else torch.cat([ev, tokens[b : b + 1]], 1)
        for b, ev in enumerate(evidence)
    ]


class Chain:
    """The chain proposer: :func:`draft_step`'s window (or the test hook ``drafter``'s), one
    branch of n positions, verified by exact match (greedy) or speculative sampling."""

    def __init__(self, request: Request, drafter: Drafter | None = None) -> None:
        self.rule = request.draft_rule
        self.labels = {
            "draft_rule": self.rule,
            "draft": request.draft,
            "proposal": request.proposal,
        }
        self.drafter = drafter
        self.sampled = not request.greedy and not request.max_throughput  # needs q

    def begin(self, state: HeadState) -> None:
        """Nothing: the draft step reads the head lazily."""

    def draft_rows(
        self, rows: Sequence[Row], evidence: Sequence[Tensor | None], spans: Sequence[int]
    ) -> list[Proposal]:
        """Every row's window: ``zmap`` rows at once (:func:`zmap_rows`) where they are at
        least r (it reads all r units' rows of W, a row alone its path's one), else each."""
        batched = self.rule == DraftRule.ZMAP and self.drafter is None and len(rows) > 1
        out: list[Proposal | None] = [None] * len(rows)
        least = max(2, rows[0].head.circuit.rank) if rows else 2
        for pre in (0, 1) if batched else ():
            group = [i for i, ev in enumerate(evidence) if (ev is not None) == bool(pre)]
            if len(group) >= least:
                windows = zmap_rows([rows[i].head for i in group], [evidence[i] for i in group])
                for i, window in zip(group, windows, strict=True):
                    out[i] = Proposal(window[:, : spans[i]], pre, Draft(window))
        return [
            p if p is not None else self.draft(row, ev, span)
            for p, row, ev, span in zip(out, rows, evidence, spans, strict=True)
        ]

    def draft(self, row: Row, evidence: Tensor | None, span: int) -> Proposal:
        """The window from ``row.head``; its first ``span`` positions are verified."""
        pre = 0 if evidence is None else evidence.shape[1]
        state = row.head
        if self.drafter is not None:
            drafted = self.drafter(state.params(), evidence, row.length - pre)  # (1, n)
            draft = MarginalProposal(state, drafted, pre).draft() if self.sampled else None
        else:
            draft = draft_step(state, evidence, self.rule, row.generator, sampling=self.sampled)
            drafted = draft.window  # (1, n)
        return Proposal(drafted[:, :span], pre, draft)  # ids (1, w)

    def verify(self, run: Run, row: Row, proposal: Proposal, target: Tensor) -> Outcome:
        """Accepts s of the m = w - pre drafts given ``target`` ``(m + 1, V)``
        (``max_throughput``: all of them)."""
        drafts = proposal.ids[0, proposal.pre :]  # (m,)
        m, rule, generator = drafts.shape[0], run.rule, row.generator
        if run.request.max_throughput:
            s, token = m, rule.pick(target[m], generator)
        elif rule.greedy:
            verdict = verify_greedy(rule.argmax(target), drafts)
            s, token = verdict.accepted, verdict.next_token
        else:
            p = rule.probs(target)  # (m + 1, V)
            draft: Draft = proposal.drafts
            assert draft.token_probs is not None and draft.proposal is not None
            q_tokens = draft.token_probs
            if isinstance(q_tokens, torch.Tensor):
                q_tokens = q_tokens[:m]  # (m,) the verified drafts' q
            verdict = verify_sampling_lazy(p, q_tokens, drafts, draft.proposal, generator)
            s, token = verdict.accepted, verdict.next_token
        return Outcome(drafts[:s].tolist(), token, drafted=m, keep=proposal.pre + s, after=s)
