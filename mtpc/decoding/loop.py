"""The self-speculative decoding loop, written once for chains and token trees (paper Alg. 2).

A :func:`cycle` drafts from the last processed state (:class:`HeadState`) and the pending
token, if any (a :class:`Proposer`: ``speculative.Chain`` or ``tree.Tree``), verifies in one
trunk + verifier-tail pass, keeps the accepted positions and applies the resume policy
(:func:`resume`). See docs/DECODING.md, "The cycle".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, cut_at_stop
from mtpc.decoding.draws import ACCEPT, DRAFT, EMIT, LATENT, Draws, row_key
from mtpc.decoding.layout import Padded, Stream, Tree


class Layout(Protocol):
    """Where the rows' caches live: ``layout.Stream`` (one row), ``layout.Padded`` (a padded
    batch with per-row slots), ``static.StaticLayout`` (fixed-capacity caches: ``compile=``,
    and EvaByte's batches, each row in its own EVA window)."""

    def admit(
        self, rows: Sequence[Any], prompts: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Prefills new rows: their trunk states ``(1, T_b, d)`` and last logits ``(1, V)``."""

    def target(
        self, rows: Sequence[Any], ids: Sequence[Tensor], trees: Sequence[Tree], last: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One trunk + verifier-tail pass over the rows' new ids."""

    def keep(self, rows: Sequence[Any], keeps: Sequence[int | Tensor]) -> None:
        """Drops the last pass's positions each row does not keep."""

    def draft(self, rows: Sequence[Any], states: Sequence[Tensor]) -> list[Tensor | None]:
        """The draft tail over each row's kept states: its last output ``(1, d)`` or None."""

    def release(self, rows: Sequence[Any]) -> None:
        """The rows leave."""


class HeadState:
    """The draft head at one state (``hidden`` ``(1, d)``, the draft tail's output), evaluated
    only where a draft step asks. ``temperature`` divides the input logits: a different
    (normalised) circuit q, not the tempered joint; any q keeps the output exact. ``lap``:
    ``Stopwatch.lap`` (the rows of W are charged to ``head``, the work before to ``circuit``).
    """

    def __init__(
        self,
        model: Any,
        hidden: Tensor,
        temperature: float | None = None,
        lap: Callable[[str], None] | None = None,
        features: Tensor | None = None,
    ) -> None:
        self.model, self.hidden = model, hidden
        self.head = model.head
        self.circuit = model.head.circuit
        self.temperature = None if temperature == 1.0 else temperature
        self.lap = lap or (lambda section: None)
        self._features = features  # (1, d), when a batch computed them; else on first use
        self._sum_logw: Tensor | None = None
        self._params: CircuitParams | None = None

    def tempered(self, logp: Tensor) -> Tensor:
        """Log-probabilities ``(..., V)`` of the tempered (renormalised) circuit leaves."""
        return logp if self.temperature is None else torch.log_softmax(logp / self.temperature, -1)

    @property
    def features(self) -> Tensor:
        """e_t ``(1, d)``: the normed draft-tail state the head reads."""
        if self._features is None:
            self._features = self.model.draft_features(self.hidden).reshape(1, -1)
        return self._features

    def sum_logw(self) -> Tensor | None:
        """Normalised sum log-weights ``(1, U, r)`` (None for ff): r·d weights per sum unit."""
        if self._params is not None:
            return self._params.sum_logw
        if self._sum_logw is None and self.circuit.num_sum_units:
            self.lap("circuit")
            self._sum_logw = self.head.sum_log_weights(self.features)
            self.lap("head")
        return self._sum_logw

    def leaf_logp(self, positions: Tensor, units: Tensor | None = None) -> Tensor:
        """Normalised (tempered) log phi (fp32) at ``positions`` ``(k,)``: of one unit each
        (``units`` ``(k,)``): ``(1, k, V)``; of every unit (None): ``(1, k, r, V)``."""
        return self.tempered(torch.log_softmax(self.leaf_logits(positions, units), -1))

    def leaf_logits(self, positions: Tensor, units: Tensor | None = None) -> Tensor:
        """Unnormalised, untempered logits of the same rows (fp32): enough for an argmax."""
        self.lap("circuit")
        out = self.head.input_logits(self.features, positions, units).float()
        self.lap("head")
        return out

    def token_logits(self, evidence: Tensor) -> Tensor:
        """Every unit's unnormalised, untempered logit at the evidence tokens ``(1, pre, r)``
        (fp32): r d-vectors of W per position, no normaliser."""
        self.lap("circuit")
        positions = torch.arange(evidence.shape[1], device=evidence.device)
        out = self.head.token_logits(self.features, positions, evidence[0]).float()
        self.lap("head")
        return out

    def params(self) -> CircuitParams:
        """theta_t with the whole (1, n, r, V) table (the full-table modes), computed once."""
        if self._params is None:
            self.lap("circuit")
            params = self.head(self.features)
            self._params = CircuitParams(self.tempered(params.input_logp), params.sum_logw)
            self.lap("head")
        return self._params


@dataclass(eq=False)
class Row:
    """One sequence's decoding state between cycles (its caches: the layout's)."""

    index: int  # the prompt's place in the call
    state: HeadState | None  # the draft head at the last processed state e_t (None: AR)
    kept_logits: Tensor  # (1, V) p(x_{t+1} | x_<=t) from the last pass
    key: tuple[int, int]  # its stream's key (draws.row_key of its seed): every draw it makes
    res: GenerationResult  # filled cycle by cycle; res.tokens: the emitted ids
    length: int  # ids processed or pending (prompt + emitted)
    pending: int | None = None  # the kept correction / bonus not yet processed (condition)

    @property
    def head(self) -> HeadState:
        """The draft head at e_t (a speculative row's)."""
        assert self.state is not None, "an autoregressive row has no draft head"
        return self.state

    @property
    def processed(self) -> int:
        """Ids in the row's caches (the pending token is not yet)."""
        return self.length - (self.pending is not None)


@dataclass
class Proposal:
    """One cycle's drafts laid out for the verify pass."""

    ids: Tensor  # (1, T) the pending token (if any), then the drafts
    pre: int  # 1 when ids start with the pending token, else 0
    drafts: Any  # the proposer's own record: a chain's Draft, a tree's TokenTree
    tree: Tree = None  # a token tree's (depth (T,), mask (T, T)) in the pass; None: a chain


@dataclass
class Outcome:
    """A verified proposal."""

    accepted: list[int]  # the s accepted drafts
    token: int  # the target's token after them: the correction, or the bonus
    drafted: int  # drafts verified (a chain's m; a tree's deepest node's depth)
    keep: int | Tensor  # positions of the pass kept: a prefix length (crop), (K,) (compact)
    after: int  # the target row after the accepted drafts (the next one after a drop)


class Proposer(Protocol):
    """What drafts and verifies: a chain or a token tree (``labels``: its result fields)."""

    labels: dict[str, Any]

    def begin(self, state: HeadState) -> None:
        """Work done as soon as a new state exists (a tree: theta_t's whole table)."""

    def draft_rows(
        self,
        rows: Sequence[Row],
        evidence: Sequence[Tensor | None],
        spans: Sequence[int],
        draws: Draws,
    ) -> list[Proposal]:
        """Each row's drafts from ``row.state`` given its pending token ``evidence`` ``(1, 1)``
        or None; ``spans``: positions one pass verifies exactly, the pending token included;
        ``draws``: the rows' streams this cycle."""

    def verify_rows(
        self,
        run: Run,
        rows: Sequence[Row],
        proposals: Sequence[Proposal],
        targets: Sequence[Tensor],
        draws: Draws,
    ) -> list[Outcome]:
        """Accepts each row's drafts given its ``target`` ``(T + 1 - pre, V)``: the target's
        logits at the first drafted position, then after each (row 1 + i: after draft i)."""


@dataclass
class Run:
    """What the rows of one decoding call share."""

    model: Any
    request: Request
    proposer: Proposer
    rule: TargetRule
    clock: Stopwatch

    def head_state(
        self, hidden: Tensor, timed: bool = True, features: Tensor | None = None
    ) -> HeadState:
        """The head at a new state ``(1, d)``, tempered when sampling; ``timed``: on the clock;
        ``features``: its normed state ``(1, d)`` when a batch computed it."""
        temperature = None if self.request.greedy else self.request.temperature
        lap = self.clock.lap if timed else None
        return HeadState(self.model, hidden, temperature, lap, features)


def new_row(index: int, request: Request, prompt: Tensor, method: str) -> Row:
    """A row before its prefill, its stream keyed by its own request's seed."""
    res = GenerationResult(tokens=[], method=method)
    return Row(index, None, prompt.new_zeros(0), row_key(request.seed), res, prompt.shape[0])


def cycle_draws(run: Run, rows: Sequence[Row]) -> Draws:
    """The rows' streams this cycle, each at its next output position: AR's one token, or a
    speculative cycle's draws (n drafts, U latent units, n tests, n + 1 emitted tokens)."""
    starts = [len(row.res.tokens) for row in rows]
    counts = {EMIT: 1}
    if run.proposer is not None:
        circuit = run.model.head.circuit
        n = circuit.window
        counts = {DRAFT: n, LATENT: circuit.num_sum_units, ACCEPT: n, EMIT: n + 1}
    return Draws([row.key for row in rows], starts, run.model.backbone.device, counts)


@torch.no_grad()
def decode(
    model: Any,
    prompts: Sequence[Tensor],
    requests: Sequence[Request],
    proposer: Proposer | None,
    size: int = 1,
    step: Step | None = None,
    layout: Layout | None = None,
) -> list[GenerationResult]:
    """Decodes many prompts, one trunk pass per cycle for all rows (self-speculative; with
    the autoregressive ``step``, no proposer: one token per pass).

    ``prompts``: ``(T_b,)`` ids on the device; ``requests``: checked (``check_request``),
    differing in the seed only; ``size``: rows at once (1: each prompt in the model's own
    caches; more: one padded batch); ``layout``: where the rows' caches live instead (the
    static engine's, for every prompt: ``compile=``, EvaByte's batches). One result per prompt, in order.
    """
    if size == 1:
        return [schedule(new_run(model, r, proposer), [p], [r], layout or Stream(model), 1,
                         step)[0]
                for p, r in zip(prompts, requests, strict=True)]  # fmt: skip
    run = new_run(model, requests[0], proposer)
    return schedule(run, prompts, requests, layout or Padded(model), size, step)


def new_run(model: Any, request: Request, proposer: Any) -> Run:
    """What the rows of one call share."""
    device = model.backbone.device
    clock = Stopwatch(device, request.profile)
    return Run(model, request, proposer, TargetRule.of(request, device), clock)


Step = Callable[[Run, "Layout", Sequence[Row]], list[Row]]


def schedule(
    run: Run,
    prompts: Sequence[Tensor],
    requests: Sequence[Request],
    layout: Layout,
    size: int,
    step: Step | None = None,
) -> list[GenerationResult]:
    """Cycles the rows until every prompt is done, ``size`` at most at once; a finished
    row's place goes to the next prompt (continuous batching). :func:`prefill` admits new rows;
    ``step`` cycles the rows, returning those done (default :func:`cycle`).
    """
    step = step or cycle
    results: list[GenerationResult | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    rows: list[Row] = []
    while waiting or rows:
        if waiting and len(rows) < size:
            take, waiting = waiting[: size - len(rows)], waiting[size - len(rows) :]
            rows += prefill(run, layout, [(i, requests[i], prompts[i]) for i in take])
        done = step(run, layout, rows)
        for row in done:
            results[row.index] = row.res
        rows = [row for row in rows if row not in done]
        layout.release(done)
    breakdown = run.clock.breakdown(run.clock.total)
    for res in results:
        assert res is not None
        res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
        res.breakdown = breakdown
    return results  # type: ignore[return-value]


def prefill(run: Run, layout: Layout, new: Sequence[tuple[int, Request, Tensor]]) -> list[Row]:
    """Every prompt token of the new rows: keeps p(x_{T+1}) and (speculative) the head at e_T."""
    method = "autoregressive" if run.proposer is None else "speculative"
    rows = [new_row(i, request, prompt, method) for i, request, prompt in new]
    hidden, kept = layout.admit(rows, [prompt for _, _, prompt in new])  # (1, T_b, d), (1, V)
    for row, logits in zip(rows, kept, strict=True):
        row.kept_logits = logits
    seconds = 0.0
    if run.proposer is not None:
        last = layout.draft(rows, hidden)
        seconds = run.clock.split()
        for row, state in zip(rows, last, strict=True):
            assert state is not None
            row.state = run.head_state(state, timed=False)
            run.proposer.begin(row.state)  # timed as the prefill, not in the cycles' sections
            row.state.lap = run.clock.lap
            row.res.policy = run.request.policy
            vars(row.res).update(run.proposer.labels)
    seconds += run.clock.split()
    for row in rows:  # each row's share of the admission (batch 1: all of it)
        row.res.prefill_seconds = seconds / len(rows)
    return rows


def cycle(run: Run, layout: Layout, rows: Sequence[Row]) -> list[Row]:
    """One draft / verify / emit / resume cycle of every row; returns the rows done."""
    model, clock = run.model, run.clock
    device, window = model.backbone.device, model.head.circuit.window
    evidence = [
        None if row.pending is None else torch.tensor([[row.pending]], device=device)
        for row in rows
    ]  # (1, 1) each
    # positions that one pass verifies exactly (EvaByte: up to its window's end)
    spans = [model.backbone.one_pass_span(row.processed, window) for row in rows]
    draws = cycle_draws(run, rows)
    proposals = run.proposer.draft_rows(rows, evidence, spans, draws)
    clock.lap("circuit")
    hidden, targets = verify_pass(run, layout, rows, proposals)
    clock.lap("model")
    outcomes = run.proposer.verify_rows(run, rows, proposals, targets, draws)
    clock.lap("verify")
    done: list[Row] = []
    going: list[Row] = []
    kept, passed, keeps, tokens, dropped = [], [], [], [], []
    for row, proposal, outcome, states, target in zip(
        rows, proposals, outcomes, hidden, targets, strict=True
    ):
        drop = settle(run, row, proposal.pre, outcome)
        if drop is None:
            done.append(row)
            continue
        going.append(row)
        if proposal.ids.numel():  # an idle row (empty tree, nothing pending) had no pass
            passed.append(row)
            keeps.append(outcome.keep)
        kept.append(
            states[:, : outcome.keep] if isinstance(outcome.keep, int) else states[:, outcome.keep]
        )
        tokens.append(outcome.token)
        dropped.append(target[outcome.after : outcome.after + 1] if drop else None)
    if passed:  # the pass's positions each row keeps (no pass: nothing to cut)
        layout.keep(passed, keeps)
    clock.lap("cache")
    kept = resume(run, layout, going, kept, tokens, dropped)
    lasts = layout.draft(going, kept)  # (1, d) each, None: no new state
    moved = [(row, last) for row, last in zip(going, lasts, strict=True) if last is not None]
    if len(moved) > 1:  # the head's features of every new state at once (B, d)
        features = model.draft_features(torch.cat([last for _, last in moved]))
    for i, (row, last) in enumerate(moved):
        row.state = run.head_state(last, features=features[i : i + 1] if len(moved) > 1 else None)
        run.proposer.begin(row.state)
    clock.lap("model")
    end_cycle(run, rows)
    return done


def end_cycle(run: Run, rows: Sequence[Row]) -> None:
    """Splits the clock: each row's share of the batch's cycle (batch 1: all of it)."""
    seconds = run.clock.split()
    run.clock.total += seconds
    for row in rows:
        row.res.cycle_seconds.append(seconds / len(rows))


def settle(run: Run, row: Row, pre: int, outcome: Outcome) -> bool | None:
    """Emits a verified proposal's tokens (``pre``: its pending tokens) and records the cycle
    (AR: an outcome of no drafts); None when the row is done, else whether the correction /
    bonus token is dropped (the ``drop`` policy)."""
    request, res = run.request, row.res
    s = len(outcome.accepted)
    drop = request.policy == "drop" and s >= 1 and not request.max_throughput
    new = outcome.accepted + ([] if drop else [outcome.token])
    room = request.max_new_tokens - len(res.tokens)
    kept, stopped = cut_at_stop(new, room, request.stop_ids, request.suppress_eos)
    res.tokens.extend(kept)
    res.accepted.append(s)
    res.emitted.append(len(kept))
    res.drafted.append(outcome.drafted)
    res.offsets.append(pre)
    row.length += len(kept)
    if stopped or len(res.tokens) >= request.max_new_tokens:
        res.stopped = stopped
        return None
    return drop


def verify_pass(
    run: Run, layout: Layout, rows: Sequence[Row], proposals: Sequence[Proposal]
) -> tuple[list[Tensor], list[Tensor]]:
    """ONE trunk + verifier-tail pass over the rows' non-empty proposals; per row, the trunk's
    states ``(1, T, d)`` and the target's logits ``(T + 1 - pre, V)``: at the first drafted
    position (the kept ones when nothing is pending), then after each drafted position."""
    if not rows:
        return [], []
    # an empty tree and nothing pending: no states, the target's kept choice only (two empty
    # tensors shared by the idle rows, not two per row in every cycle)
    kept = rows[0].kept_logits  # (1, V)
    hidden = [kept.new_zeros(1, 0, run.model.backbone.hidden_size)] * len(rows)
    targets = [kept.new_zeros(0, kept.shape[-1])] * len(rows)
    busy = [i for i, p in enumerate(proposals) if p.ids.numel()]
    if busy:
        ids, trees = [proposals[i].ids[0] for i in busy], [proposals[i].tree for i in busy]
        states, logits = layout.target([rows[i] for i in busy], ids, trees)
        for i, h, out in zip(busy, states, logits, strict=True):
            hidden[i], targets[i] = h, out
            rows[i].res.trunk_passes += 1
    return hidden, [
        out if row.pending is not None else torch.cat([row.kept_logits, out])
        for row, out in zip(rows, targets, strict=True)
    ]


def resume(
    run: Run,
    layout: Layout,
    rows: Sequence[Row],
    kept: Sequence[Tensor],
    tokens: Sequence[int],
    dropped: Sequence[Tensor | None],
) -> list[Tensor]:
    """Applies the resume policy to each row's emitted correction / bonus token (sets
    ``pending``, ``kept_logits``; ``dropped`` ``(1, V)``: the target after the accepted
    drafts, on a ``drop``). ``kept`` ``(1, K, d)``: each row's kept trunk states (the caches
    already cut to them). Returns the states the draft tail runs on."""
    out = list(kept)
    extra = []
    for i, (row, token, after) in enumerate(zip(rows, tokens, dropped, strict=True)):
        if after is not None:  # the paper's Alg. 2: redraft from e_{t+s}; re-verify the token
            row.pending, row.kept_logits = None, after
        elif run.request.policy == "condition":
            row.pending = token
        else:  # recompute (and drop after s = 0): one extra pass for the kept token's state
            extra.append(i)
    if extra:
        ids = [torch.tensor([tokens[i]], device=kept[i].device) for i in extra]
        states, logits = layout.target([rows[i] for i in extra], ids, [None] * len(extra))
        for i, state, last in zip(extra, states, logits, strict=True):
            rows[i].pending, rows[i].kept_logits = None, last  # (1, V)
            rows[i].res.trunk_passes += 1
            out[i] = torch.cat([out[i], state], 1)  # (1, K + 1, d)
    return out
