"""Exactly lossless self-speculative decoding with a circuit draft: the chain (paper Sec. 3.4):
what a chain drafts (:func:`draft_step`) and how it is verified; the loop is
``mtpc.decoding.loop``'s. See docs/DECODING.md, "Drafting" and "The draft step".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from mtpc.circuits.engine import categorical
from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import Request
from mtpc.decoding.draws import ACCEPT, DRAFT, EMIT, LATENT, Draws
from mtpc.decoding.loop import HeadState, Outcome, Proposal, Row, Run
from mtpc.decoding.settings import DraftRule
from mtpc.decoding.verify import accept_greedy, accept_sampling, correction_or_bonus

Drafter = Callable[[CircuitParams, Tensor | None, int], Tensor]
"""Test hook: ``(params, evidence (1, m) or None, position) -> window (1, n)``, where
``position`` is the index (among prompt + generated ids) of the window's first token."""


class DraftUniforms(NamedTuple):
    """One row's draws for a draft step (its stream's, ``mtpc.decoding.draws``)."""

    latent: Tensor | None  # (1, U) the latent path's, one per sum unit (None: no sum unit)
    tokens: Tensor  # (n,) the i-th drafted token's (the window's drafted positions, in order)


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
    uniforms: DraftUniforms | None = None,
) -> Draft:
    """One draft from ``state``: the window and, when ``sampling``, the proposal verification
    needs. ``evidence``: ``(1, pre)`` the pending token, or None; ``mode``: a ``DraftRule``
    value (sampling needs ``sample``, ``zsample`` or ``zsample1``); a drawn draft reads
    ``uniforms`` (the decoder's), else ``generator``'s."""
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
            state.sum_logw(),
            evidence_leaves,
            most_probable=mode == "zmap",
            generator=generator,
            uniforms=None if uniforms is None else uniforms.latent,
        )  # (1, n)
        units = path[0, pre:]
    positions = torch.arange(pre, n)
    if mode == "zmap":  # the argmax needs no normaliser
        tokens = state.leaf_logits(positions, units)[0].argmax(-1)  # (m,)
        return Draft(tokens[None] if evidence is None else torch.cat([evidence, tokens[None]], 1))
    logp = state.leaf_logp(positions, units)[0]  # (m, V)
    u = None if uniforms is None else uniforms.tokens[: n - pre]  # (m,)
    tokens = categorical(logp, generator, u)  # with z, an ancestral sample
    window = tokens[None] if evidence is None else torch.cat([evidence, tokens[None]], 1)
    return drawn_draft(state, window, pre, rows, logp.exp(), mode, sampling)


def drawn_draft(
    state: HeadState,
    window: Tensor,
    pre: int,
    rows: Tensor | None,
    probs: Tensor,
    mode: str,
    sampling: bool,
) -> Draft:
    """A drawn ``window`` ``(1, n)`` with what verifying it needs when ``sampling``: ``mode``'s
    proposal, from ``probs`` ``(m, V)`` q_i(. | z) (independent of the earlier drafts given
    z) or the circuit's marginal; ``rows`` ``(1, pre, r, V)``: the evidence's leaves, if read.
    """
    if not sampling:
        return Draft(window)
    if mode == "sample" and state.circuit.rank > 1:  # r = 1: q(. | z) is the marginal
        return MarginalProposal(state, window, pre, rows).draft()
    tokens = window[0, pre:]  # (m,)
    if mode == "zsample1" and state.circuit.rank > 1:
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


def rows_at_once(
    states: Sequence[HeadState],
    evidence: Sequence[Tensor | None],
    mode: str,
    sampling: bool,
    latent: Tensor | None = None,
    tokens: Tensor | None = None,
) -> list[Draft]:
    """:func:`draft_step` of B rows in one pass over the head: every unit's leaves at the
    drafted positions for all rows (W's rows read once), the rows' latent paths in one call,
    each row's tokens on its path: ``zmap``'s argmaxes (``tokens`` None), or a drawn draft's
    (``zsample``, ``zsample1``, ``sample``) by inverse CDF with the rows' uniforms ``latent``
    ``(B, U)`` and ``tokens`` ``(B, n)``. ``evidence``: each row's pending token ``(1, 1)``,
    all None or none. A lazy proposal (the marginals) stays the row's own."""
    head, circuit, first = states[0].head, states[0].circuit, states[0]
    n, r = circuit.window, circuit.rank
    pre = 0 if evidence[0] is None else 1
    if pre == n:  # nothing to draft (n = 1 with a pending token)
        return [Draft(ev) for ev in evidence if ev is not None]
    e = torch.cat([s.features for s in states])  # (B, d)
    every = pre > 0 and r > 1 and tokens is not None  # drawn: every unit at the pending token too
    logits = head.input_logits(e, list(range(0 if every else pre, n)))  # (B, n - start, r, V)
    leaves = evidence_rows = None
    if every:  # (as draft_step)
        evidence_rows = first.tempered(torch.log_softmax(logits[:, :1].float(), -1))
        pending = torch.cat([ev for ev in evidence if ev is not None])  # (B, 1)
        leaves = evidence_rows[:, 0].gather(2, pending[:, None, :].expand(-1, r, 1))[:, None, :, 0]
        logits = logits[:, 1:]  # (B, m, r, V)
    elif pre and r > 1:  # zmap: each unit's logit at the pending token, no normaliser
        w = head.unembedding  # (n, r, V, d)
        pending = torch.cat([ev[0] for ev in evidence if ev is not None])  # (B,)
        rows = w[0][:, pending].transpose(0, 1)  # (B, r, d)
        leaves = torch.einsum("bd,brd->br", e.to(w.dtype), rows).float()[:, None]
    units = logits.new_zeros(len(states), n - pre, dtype=torch.long)  # r = 1: the only path
    if r > 1:
        sum_logw = head.sum_log_weights(e)  # (B, U, r)
        path = circuit.latent_path(sum_logw, leaves, most_probable=tokens is None, uniforms=latent)
        units = path[:, pre:]  # (B, m)
    index = units[:, :, None, None].expand(-1, -1, 1, logits.shape[-1])
    on_path = logits.gather(2, index)[:, :, 0].float()  # (B, m, V)
    probs = None
    if tokens is None:  # zmap: the argmax needs no normaliser
        drafted = on_path.argmax(-1)  # (B, m)
    else:
        logp = first.tempered(torch.log_softmax(on_path, -1))
        drafted = categorical(logp, u=tokens[:, : n - pre])  # (B, m): with z, ancestral samples
        probs = logp.exp()  # (B, m, V)
    out = []
    for b, (state, ev) in enumerate(zip(states, evidence, strict=True)):
        window = drafted[b : b + 1] if ev is None else torch.cat([ev, drafted[b : b + 1]], 1)
        rows = None if evidence_rows is None else evidence_rows[b : b + 1]  # (1, 1, r, V)
        if probs is None:
            out.append(Draft(window))
        else:
            out.append(drawn_draft(state, window, pre, rows, probs[b], mode, sampling))
    return out


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
        self,
        rows: Sequence[Row],
        evidence: Sequence[Tensor | None],
        spans: Sequence[int],
        draws: Draws,
    ) -> list[Proposal]:
        """Every row's window: ``zmap`` and drawn rows at once (:func:`rows_at_once`) where
        they are at least r (it reads all r units' rows of W, a row alone its path's one), else
        each; a drawn draft's uniforms for all rows in one tensor op."""
        uniforms: list[DraftUniforms | None] = [None] * len(rows)
        latent = tokens = None
        if self.rule in DRAWN and self.drafter is None and rows:
            circuit = rows[0].head.circuit
            latent = draws.take(LATENT, circuit.num_sum_units) if circuit.num_sum_units else None
            tokens = draws.take(DRAFT, circuit.window)  # (B, n)
            uniforms = [
                DraftUniforms(None if latent is None else latent[b : b + 1], tokens[b])
                for b in range(len(rows))
            ]
        batched = self.rule == DraftRule.ZMAP or (tokens is not None and tokens.shape[1] > 1)
        out: list[Proposal | None] = [None] * len(rows)
        for pre in (0, 1) if batched and self.drafter is None and len(rows) > 1 else ():
            group = [i for i, ev in enumerate(evidence) if (ev is not None) == bool(pre)]
            if len(group) < max(2, rows[0].head.circuit.rank):
                continue
            drafts = rows_at_once(
                [rows[i].head for i in group],
                [evidence[i] for i in group],
                self.rule,
                self.sampled,
                None if latent is None else latent[group],
                None if tokens is None else tokens[group],
            )
            for i, draft in zip(group, drafts, strict=True):
                out[i] = Proposal(draft.window[:, : spans[i]], pre, draft)
        return [
            p if p is not None else self.draft(row, ev, span, u)
            for p, row, ev, span, u in zip(out, rows, evidence, spans, uniforms, strict=True)
        ]

    def draft(
        self, row: Row, evidence: Tensor | None, span: int, uniforms: DraftUniforms | None
    ) -> Proposal:
        """The window from ``row.head``; its first ``span`` positions are verified."""
        pre = 0 if evidence is None else evidence.shape[1]
        state = row.head
        if self.drafter is not None:
            drafted = self.drafter(state.params(), evidence, row.length - pre)  # (1, n)
            draft = MarginalProposal(state, drafted, pre).draft() if self.sampled else None
        else:
            draft = draft_step(
                state, evidence, self.rule, None, sampling=self.sampled, uniforms=uniforms
            )
            drafted = draft.window  # (1, n)
        return Proposal(drafted[:, :span], pre, draft)  # ids (1, w)

    def verify_rows(
        self,
        run: Run,
        rows: Sequence[Row],
        proposals: Sequence[Proposal],
        targets: Sequence[Tensor],
        draws: Draws,
    ) -> list[Outcome]:
        """Accepts s_b of the m_b = w_b - pre_b drafts of every row at once given its
        ``target`` ``(m_b + 1, V)`` (``max_throughput``: all of them); rows of fewer drafts
        are padded (docs/DECODING.md, "Batched acceptance")."""
        drafts = [p.ids[0, p.pre :] for p in proposals]  # (m_b,) each
        counts = [d.shape[0] for d in drafts]
        lengths = torch.tensor(counts, device=targets[0].device)  # (B,)
        padded = pad_sequence(drafts, batch_first=True)  # (B, M)
        target = pad_sequence(list(targets), batch_first=True)  # (B, M + 1, V)
        rule = run.rule
        if run.request.max_throughput:
            s = lengths
            u = None if rule.greedy else draws.at(EMIT, s)
            tokens = rule.draw(target[torch.arange(len(rows)), s], u)  # (B,)
        elif rule.greedy:
            verdicts = accept_greedy(rule.argmax(target), padded, lengths)
            s, tokens = verdicts.accepted, verdicts.tokens
        else:
            p = rule.probs(target)  # (B, M + 1, V)
            p_drafts = p[:, :-1].gather(2, padded[..., None])[..., 0].double()  # (B, M)
            u = draws.take(ACCEPT, padded.shape[1])  # (B, M)
            q = drafted_probs([p.drafts for p in proposals], counts, p_drafts, u)
            s = accept_sampling(p_drafts, q, u, lengths)
            q_s = p.new_zeros(len(rows), p.shape[2])  # (B, V): q_s(.) where s < m_b, else unread
            for b, (proposal, k, m) in enumerate(zip(proposals, s.tolist(), counts, strict=True)):
                if k < m:
                    q_s[b] = proposal.drafts.proposal(k)
            tokens = correction_or_bonus(p, s, lengths, q_s, draws.at(EMIT, s))
        return [
            Outcome(d[:k], token, drafted=m, keep=proposal.pre + k, after=k)
            for d, k, token, m, proposal in zip(
                padded.tolist(), s.tolist(), tokens.tolist(), counts, proposals, strict=True
            )
        ]


DRAWN = (DraftRule.SAMPLE, DraftRule.ZSAMPLE, DraftRule.ZSAMPLE1)
"""The draft rules that draw (a latent path, then tokens)."""


def drafted_probs(drafts: Sequence[Draft], counts: Sequence[int], p: Tensor, u: Tensor) -> Tensor:
    """q_i(x_i) ``(B, M)`` float64 of every row's drafts, as far as the acceptance tests need
    it: a row's vector as is; a row whose q_i is computed on demand (a callable) asked only
    where u_i >= p_i(x_i) (below, x_i is accepted whatever q_i <= 1), in order, up to its
    first rejection; 1 elsewhere (accepted: ``accept_sampling`` reads p_i / 1 > u_i).
    ``p`` ``(B, M)``: p_i(x_i); ``u`` ``(B, M)``."""
    columns = [
        d.token_probs[:m].double() if isinstance(d.token_probs, Tensor) else p.new_ones(m)
        for d, m in zip(drafts, counts, strict=True)
    ]
    q = pad_sequence(columns, batch_first=True, padding_value=1.0) if columns else p
    lazy = [b for b, d in enumerate(drafts) if callable(d.token_probs)]
    if lazy:
        unsure = ((u >= p)[lazy]).tolist()
        u_host, p_host = u[lazy].tolist(), p[lazy].tolist()
        for j, b in enumerate(lazy):
            ask = drafts[b].token_probs
            assert callable(ask)
            for i in range(counts[b]):
                if unsure[j][i]:
                    q_i = float(ask(i))
                    q[b, i] = q_i
                    if q_i > 0 and u_host[j][i] >= p_host[j][i] / q_i:
                        break
    return q
