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


def drawn_rows(
    states: Sequence[HeadState],
    evidence: Sequence[Tensor | None],
    latent: Tensor | None,
    tokens: Tensor,
    mode: str,
    sampling: bool,
) -> list[Draft]:
    """:func:`draft_step`'s drawn drafts (``zsample``, ``zsample1``, ``sample``) of B rows in
    one pass over the head, as :func:`zmap_rows`: every unit's (tempered) leaves at the
    drafted positions for all rows, the rows' latent paths in one call, each row's tokens by
    inverse CDF. ``evidence``: each row's pending token ``(1, 1)``, all None or none, fewer
    than n; ``latent`` ``(B, U)``, ``tokens`` ``(B, n)``: the rows' uniforms. Returns each
    row's draft; a lazy proposal (the marginals) stays the row's own."""
    head, circuit, first = states[0].head, states[0].circuit, states[0]
    n, r = circuit.window, circuit.rank
    pre = 0 if evidence[0] is None else 1
    e = torch.cat([s.features for s in states])  # (B, d)
    start = 0 if pre and r > 1 else pre  # r > 1: every unit at the pending token's too
    logits = head.input_logits(e, list(range(start, n)))  # (B, n - start, r, V)
    leaves = evidence_rows = None  # (B, k, r, V): W's rows read once for all rows
    if pre and r > 1:  # every unit at the pending token's position (as draft_step)
        evidence_rows = first.tempered(torch.log_softmax(logits[:, :1].float(), -1))
        pending = torch.cat([ev for ev in evidence if ev is not None])  # (B, 1)
        leaves = evidence_rows[:, 0].gather(2, pending[:, None, :].expand(-1, r, 1))[:, None, :, 0]
        logits = logits[:, 1:]  # (B, m, r, V)
    if r == 1:
        units = torch.zeros_like(tokens[:, pre:], dtype=torch.long)  # (B, m): the only path
    else:
        sum_logw = head.sum_log_weights(e)  # (B, U, r)
        units = circuit.latent_path(sum_logw, leaves, uniforms=latent)[:, pre:]  # (B, m)
    index = units[:, :, None, None].expand(-1, -1, 1, logits.shape[-1])
    logp = first.tempered(torch.log_softmax(logits.gather(2, index)[:, :, 0].float(), -1))
    drawn = categorical(logp, u=tokens[:, : n - pre])  # (B, m): with z, ancestral samples
    probs = logp.exp()  # (B, m, V)
    out = []
    for b, (state, ev) in enumerate(zip(states, evidence, strict=True)):
        window = drawn[b : b + 1] if ev is None else torch.cat([ev, drawn[b : b + 1]], 1)
        rows = None if evidence_rows is None else evidence_rows[b : b + 1]  # (1, 1, r, V)
        if not sampling:
            out.append(Draft(window))
        elif mode == "sample" and r > 1:
            out.append(MarginalProposal(state, window, pre, rows).draft())
        elif mode == "zsample1" and r > 1:
            marginal = MarginalProposal(state, window, pre, rows)
            proposal = FirstMarginal(marginal, probs[b], drawn[b])
            out.append(Draft(window, proposal.token_prob, proposal.dist))
        else:
            q = probs[b].gather(1, drawn[b, :, None])[:, 0]  # (m,)
            out.append(Draft(window, q, probs[b].__getitem__))
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
        """Every row's window: ``zmap`` rows at once (:func:`zmap_rows`) where they are at
        least r (it reads all r units' rows of W, a row alone its path's one), else each; a
        drawn draft's uniforms for all rows in one tensor op."""
        batched = self.rule == DraftRule.ZMAP and self.drafter is None and len(rows) > 1
        out: list[Proposal | None] = [None] * len(rows)
        least = max(2, rows[0].head.circuit.rank) if rows else 2
        for pre in (0, 1) if batched else ():
            group = [i for i, ev in enumerate(evidence) if (ev is not None) == bool(pre)]
            if len(group) >= least:
                windows = zmap_rows([rows[i].head for i in group], [evidence[i] for i in group])
                for i, window in zip(group, windows, strict=True):
                    out[i] = Proposal(window[:, : spans[i]], pre, Draft(window))
        uniforms: list[DraftUniforms | None] = [None] * len(rows)
        if self.rule in DRAWN and self.drafter is None and rows:
            circuit = rows[0].head.circuit
            latent = draws.take(LATENT, circuit.num_sum_units) if circuit.num_sum_units else None
            tokens = draws.take(DRAFT, circuit.window)  # (B, n)
            uniforms = [
                DraftUniforms(None if latent is None else latent[b : b + 1], tokens[b])
                for b in range(len(rows))
            ]
            for pre in (0, 1) if len(rows) > 1 and circuit.window > 1 else ():
                group = [i for i, ev in enumerate(evidence) if (ev is not None) == bool(pre)]
                if len(group) >= least:
                    pick = torch.tensor(group, device=tokens.device)
                    drafts = drawn_rows(
                        [rows[i].head for i in group],
                        [evidence[i] for i in group],
                        None if latent is None else latent[pick],
                        tokens[pick],
                        self.rule,
                        self.sampled,
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
            q_s = residual_proposals([p.drafts for p in proposals], s.tolist(), counts, p)
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


def residual_proposals(
    drafts: Sequence[Draft], accepted: Sequence[int], counts: Sequence[int], p: Tensor
) -> Tensor:
    """q_s(.) ``(B, V)`` of the rows that rejected draft s (zeros elsewhere: unread)."""
    out = p.new_zeros(p.shape[0], p.shape[2])
    for b, (d, s, m) in enumerate(zip(drafts, accepted, counts, strict=True)):
        if s < m:
            assert d.proposal is not None
            out[b] = d.proposal(s)
    return out
