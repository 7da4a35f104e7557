"""The self-speculative decoding loop, written once for chains and token trees (paper Alg. 2).

One trunk pass per draft/verify cycle. Notation: e_t is the state after reading x_t; the
verifier at e_t gives p(x_{t+1} | x_<=t), the draft at e_t gives the circuit
q(x_{t+1..t+n} | x_<=t).

A cycle (:func:`cycle`) starts from the last processed state e_t, its circuit parameters
theta_t (the head there: :class:`HeadState`), and either

* nothing pending (after the prefill, a ``recompute`` or a ``drop``): the verifier's
  p(x_{t+1} | x_<=t) is kept from the previous pass; draft x_{t+1..t+n} ~ q; or
* a pending token c = x_{t+1} (``condition``: the previous cycle's correction or bonus,
  already emitted): draft x_{t+2..t+n} ~ q(. | x_{t+1} = c), the circuit conditioned on c
  as evidence (exact for a PC).

A :class:`Proposer` drafts and verifies: a chain (``speculative.Chain``, one branch of n
tokens) or a token tree (``tree.Tree``, B nodes under a tree mask). The rest is the loop's:
one trunk + verifier-tail pass over [c] + the drafts gives the target's distributions after
every drafted prefix; the proposer accepts s drafts and names the next token (correction,
or bonus when every draft was accepted); the caches keep the pending token and the accepted
positions; the draft tail runs on exactly those kept trunk states (the new e_t, theta_t).

Resume policies for the emitted correction / bonus token (:func:`resume`):

* ``condition`` (default): keep it as the next cycle's pending token (no extra pass; every
  cycle emits s + 1 tokens). Exact for greedy and sampling.
* ``recompute``: keep it and run one extra trunk pass on it for its state. Exact.
* ``drop``: the paper's Alg. 2: drop it when s >= 1 and redraft from e_{t+s} (the next
  cycle re-verifies that position); when s = 0 keep it and recompute. Exact for greedy
  only; biased for sampling (target p = (1/2, 1/2), a draft that always proposes A:
  P(A) = 3/4 at the second position).

A sequence's state is one :class:`Row` and the cycle a function of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, emit


class HeadState:
    """The draft head at one decoding state, evaluated only where a draft step asks.

    Args:
        model: an ``MTPCModel``.
        hidden: the draft tail's output at the state, ``(1, d)``.
        temperature: divides the input logits (sampling), None or 1.0: untempered.
        lap: ``Stopwatch.lap``; the rows of W are charged to ``head``, the work before them
            to ``circuit``.

    Tempering the input units is a different (still normalised) circuit q, not the tempered
    joint; any q keeps the output exact, a closer one is accepted more often.
    """

    def __init__(
        self,
        model: Any,
        hidden: Tensor,
        temperature: float | None = None,
        lap: Callable[[str], None] | None = None,
    ) -> None:
        self.model, self.hidden = model, hidden
        self.head = model.head
        self.circuit = model.head.circuit
        self.temperature = None if temperature == 1.0 else temperature
        self.lap = lap or (lambda section: None)
        self._features: Tensor | None = None
        self._sum_logw: Tensor | None = None
        self._params: CircuitParams | None = None

    def _tempered(self, logp: Tensor) -> Tensor:
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
        """Normalised (tempered) log phi of some input units, in fp32.

        Args:
            positions: ``(k,)`` window positions.
            units: ``(k,)`` one unit per position, or None: every unit of the positions.

        Returns:
            ``(1, k, V)`` with ``units``, ``(1, k, r, V)`` without.
        """
        return self._tempered(torch.log_softmax(self.leaf_logits(positions, units), -1))

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
            params = self.model.draft_params(self.hidden)
            self._params = CircuitParams(self._tempered(params.input_logp), params.sum_logw)
            self.lap("head")
        return self._params


@dataclass
class Row:
    """One sequence's decoding state between cycles (batched decoding: one per sequence)."""

    caches: Any  # the model's Caches: trunk, verifier tail, draft tail
    state: HeadState  # the draft head at the last processed state e_t
    kept_logits: Tensor  # (1, V) p(x_{t+1} | x_<=t) from the last pass
    generator: torch.Generator  # the draws and the acceptance tests
    res: GenerationResult  # filled cycle by cycle; res.tokens: the emitted ids
    length: int  # ids processed or pending (prompt + emitted)
    pending: int | None = None  # the kept correction / bonus not yet processed (condition)


@dataclass
class Proposal:
    """One cycle's drafts laid out for the verify pass."""

    ids: Tensor  # (1, T) the pending token (if any), then the drafts
    pre: int  # 1 when ids start with the pending token, else 0
    drafts: Any  # the proposer's own record: a chain's Draft, a tree's TokenTree
    depth: Tensor | None = None  # (T,) offsets from the cache length (a tree's); None: 0..T-1
    tree_mask: Tensor | None = None  # (T, T) who sees whom (a tree); None: causal


@dataclass
class Outcome:
    """A verified proposal."""

    accepted: list[int]  # the s accepted drafts
    token: int  # the target's token after them: the correction, or the bonus
    drafted: int  # drafts verified (a chain's m; a tree's deepest node's depth)
    keep: int | Tensor  # positions of the pass kept: a prefix length (crop), (K,) (compact)
    after: int  # the target row after the accepted drafts (the next one after a drop)


class Proposer(Protocol):
    """What drafts and verifies: a chain or a token tree. ``labels`` name it in the result
    (its ``draft_rule``, ``draft`` and ``proposal``)."""

    labels: dict[str, Any]

    def begin(self, state: HeadState) -> None:
        """Work done as soon as a new state exists (a tree: theta_t's whole table)."""

    def draft(self, row: Row, evidence: Tensor | None, span: int) -> Proposal:
        """Drafts from ``row.state`` given the pending token ``evidence`` ``(1, 1)`` (or
        None); ``span``: positions one pass verifies exactly (EvaByte: to its window's end),
        the pending token included."""
        ...

    def verify(self, run: Run, row: Row, proposal: Proposal, target: Tensor) -> Outcome:
        """Accepts drafts given ``target`` ``(T + 1 - pre, V)``: the target's logits at the
        first drafted position, then after each drafted position (row 1 + i: after draft i)."""
        ...


@dataclass
class Run:
    """What the rows of one decoding call share."""

    model: Any
    request: Request
    proposer: Proposer
    rule: TargetRule
    clock: Stopwatch

    def head_state(self, hidden: Tensor, timed: bool = True) -> HeadState:
        """The head at a new state ``(1, d)``, tempered when sampling; ``timed``: its work is
        charged to the clock's sections."""
        temperature = None if self.request.greedy else self.request.temperature
        return HeadState(self.model, hidden, temperature, self.clock.lap if timed else None)


def target_step(model: Any, ids: Tensor, caches: Any) -> tuple[Tensor, Tensor]:
    """Trunk and verifier tail on ``ids`` ``(1, T)`` after the cached ones.

    Returns:
        The trunk's states ``(1, T, d)`` and the target's logits after the last id ``(1, V)``.
    """
    hidden = model.trunk(ids, caches.trunk)  # (1, T, d)
    return hidden, model.verifier_logits(model.verifier_tail(hidden, caches.verifier)[:, -1])


@torch.no_grad()
def decode(model: Any, prompt: Tensor, request: Request, proposer: Proposer) -> GenerationResult:
    """Self-speculative decoding of one prompt, one trunk pass per cycle.

    Args:
        model: an ``MTPCModel``.
        prompt: (1, T) ids on the model's device.
        request: checked arguments (``mtpc.decoding.common.check_request``).
        proposer: a chain or a token tree.

    Returns:
        A :class:`GenerationResult`.
    """
    device = model.backbone.device
    generator = torch.Generator(device=device).manual_seed(request.seed)
    rule = TargetRule.of(request, device)
    caches = model.new_caches()
    run = Run(model, request, proposer, rule, Stopwatch(device, request.profile))
    row = prefill(run, prompt, caches, generator)
    while not cycle(run, row):
        pass
    res = row.res
    res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
    res.breakdown = run.clock.breakdown(sum(res.cycle_seconds))
    return res


def prefill(run: Run, prompt: Tensor, caches: Any, generator: torch.Generator) -> Row:
    """Every prompt token: keeps p(x_{T+1}) and the head at e_T."""
    model = run.model
    hidden, kept_logits = target_step(model, prompt, caches)  # (1, T, d), (1, V)
    state = run.head_state(model.draft_tail(hidden, caches.draft)[:, -1], timed=False)
    run.proposer.begin(state)  # timed as the prefill, not in the cycles' sections
    state.lap = run.clock.lap
    res = GenerationResult(
        tokens=[],
        method="speculative",
        policy=run.request.policy,
        **run.proposer.labels,
        prefill_seconds=run.clock.split(),
    )
    return Row(caches, state, kept_logits, generator, res, prompt.shape[1])


def cycle(run: Run, row: Row) -> bool:
    """One draft / verify / emit / resume cycle of a row; True when the row is done."""
    model, request, clock = run.model, run.request, run.clock
    caches, res = row.caches, row.res
    pre = 0 if row.pending is None else 1
    evidence = (
        None if row.pending is None else torch.tensor([[row.pending]], device=model.backbone.device)
    )
    base = len(caches.trunk)
    # positions base.. that one pass verifies exactly (EvaByte: up to its window's end)
    span = model.backbone.one_pass_span(base, model.head.circuit.window)
    proposal = run.proposer.draft(row, evidence, span)
    clock.lap("circuit")

    hidden, target = verify_pass(run, row, proposal, base)
    clock.lap("model")
    outcome = run.proposer.verify(run, row, proposal, target)
    clock.lap("verify")

    s = len(outcome.accepted)
    drop = request.policy == "drop" and s >= 1 and not request.max_throughput
    new = outcome.accepted + ([] if drop else [outcome.token])
    count, stopped = emit(res.tokens, new, request, ignore_stops=request.suppress_eos)
    res.accepted.append(s)
    res.emitted.append(count)
    res.drafted.append(outcome.drafted)
    res.offsets.append(pre)
    row.length += count
    if stopped or len(res.tokens) >= request.max_new_tokens:
        res.stopped = stopped
        res.cycle_seconds.append(clock.split())
        return True

    kept = keep_states(caches, hidden, base, outcome.keep)
    clock.lap("cache")
    kept = resume(run, row, kept, outcome.token, drop, target[outcome.after : outcome.after + 1])
    if kept.shape[1]:
        last = model.draft_tail(kept, caches.draft)[:, -1]  # (1, d)
        clock.lap("model")
        row.state = run.head_state(last)
        run.proposer.begin(row.state)
    clock.lap("cache")
    res.cycle_seconds.append(clock.split())
    return False


def verify_pass(run: Run, row: Row, proposal: Proposal, base: int) -> tuple[Tensor, Tensor]:
    """ONE trunk + verifier-tail pass over the proposal (none when it is empty).

    Returns:
        The trunk's states ``(1, T, d)`` and the target's logits ``(T + 1 - pre, V)``: at the
        first drafted position (the kept ones when nothing is pending), then after each
        drafted position.
    """
    model, caches, kept_logits = run.model, row.caches, row.kept_logits
    if proposal.ids.numel():
        tree = {} if proposal.depth is None else {"positions": base + proposal.depth}  # (T,)
        if proposal.tree_mask is not None:
            tree["tree_mask"] = proposal.tree_mask
        hidden = model.trunk(proposal.ids, caches.trunk, **tree)  # (1, T, d)
        tail = model.verifier_tail(hidden, caches.verifier, **tree)
        logits = model.verifier_logits(tail)[0]  # (T, V)
        row.res.trunk_passes += 1
    else:  # an empty tree and nothing pending: the target's kept choice only
        hidden = kept_logits.new_zeros(1, 0, model.backbone.hidden_size)
        logits = kept_logits.new_zeros(0, kept_logits.shape[-1])
    return hidden, (logits if row.pending is not None else torch.cat([kept_logits, logits]))


def keep_states(caches: Any, hidden: Tensor, base: int, keep: int | Tensor) -> Tensor:
    """Drops the verify pass's rejected positions (after ``base``) from the trunk and verifier
    caches: all but a prefix of ``keep`` (a chain) or the ``(K,)`` indices ``keep`` (a tree).
    Returns the kept trunk states ``(1, K, d)`` of ``hidden`` ``(1, T, d)``."""
    width = hidden.shape[1]
    if isinstance(keep, int):
        if keep < width:
            caches.trunk.crop(base + keep)
            caches.verifier.crop(base + keep)
        return hidden[:, :keep]
    if keep.numel() < width:
        caches.compact(base, keep)
    return hidden[:, keep]


def resume(run: Run, row: Row, kept: Tensor, token: int, drop: bool, dropped: Tensor) -> Tensor:
    """Applies the resume policy to the emitted correction / bonus ``token``: sets
    ``row.pending`` and ``row.kept_logits`` (``dropped`` ``(1, V)``, the target after the
    accepted drafts, on a ``drop``). ``kept`` ``(1, K, d)``: the kept positions' trunk states
    (the caches already compacted to them). Returns the states the draft tail runs on."""
    if drop:  # the paper's Alg. 2: redraft from e_{t+s}; the next cycle re-verifies the token
        row.pending, row.kept_logits = None, dropped
        return kept
    if run.request.policy == "condition":
        row.pending = token
        return kept
    # recompute (and drop after s = 0): one extra pass for the kept token's state
    ids = torch.tensor([[token]], device=kept.device)
    extra, row.kept_logits = target_step(run.model, ids, row.caches)  # (1, 1, d), (1, V)
    row.pending = None
    row.res.trunk_passes += 1
    return torch.cat([kept, extra], 1)
