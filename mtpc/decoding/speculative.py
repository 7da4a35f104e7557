"""Exactly lossless self-speculative decoding with a circuit draft (paper Sec. 3.4, Alg. 2-3).

One trunk pass per draft/verify cycle. Notation: e_t is the state after reading x_t; the
verifier at e_t gives p(x_{t+1} | x_<=t), the draft at e_t gives the circuit
q(x_{t+1..t+n} | x_<=t).

A cycle starts from the last processed state e_t, its circuit parameters theta_t, and either

* nothing pending (after the prefill, a ``recompute`` or a ``drop``): the verifier's
  p(x_{t+1} | x_<=t) is kept from the previous pass; draft x_{t+1..t+n} ~ q; or
* a pending token c = x_{t+1} (``condition``: the previous cycle's correction or bonus,
  already emitted): draft x_{t+2..t+n} ~ q(. | x_{t+1} = c), the circuit conditioned on c
  as evidence (exact for a PC).

The verify pass runs trunk + verifier tail over the window [x_{t+1}..x_{t+n}] (c first when
pending), which gives the target distributions after every window prefix. Verification
(greedy exact match or rejection sampling with the circuit's exact conditionals
q(x_{i} | x_<i) = ratio of prefix marginals, and the residual) accepts s drafts and emits the
next token (correction, or bonus when every draft was accepted). The caches keep the
pending token and the s accepted positions; the rejected ones are cropped. The draft tail
then runs on exactly those kept trunk states, giving the new last state and theta.

The internal modes named below are the public (``draft``, ``proposal``) choices mapped by
``mtpc.decoding.settings`` (the one table: docs/DECODING.md, "Drafting").

The draft step (:func:`draft_step`) reads the head through a :class:`HeadState`, which
computes input logits only where asked. ``map`` and ``chain`` take all n·r·V of them; the
path-drawn modes take what they use. They pick a latent path z from the sum weights and every
unit's leaf at the evidence position (its value at the pending token): ``zmap`` (greedy)
takes each sum unit's most probable child given the evidence (scored by each unit's logit at
the pending token, without the normalisers that would need every row), then each drafted
position's leaf argmax on z; ``zsample`` and ``sample`` draw z from its posterior, then each drafted
position from its leaf on z (an ancestral sample). Sampling with ``zsample`` verifies against
q(. | z): z is drawn before the target is seen and independently of it, and given z the
positions are independent, so speculative sampling with the proposals q_i(.) = phi_{i, z_i}
is exact for every z; a rejection's residual needs q_s(. | z), the row already computed.
``sample`` verifies against the marginal q(x_i | x_<i) (:class:`MarginalProposal`), which
reads every unit at a position only when a test asks for q there. ``zsample1`` takes the
same draw and verifies the first draft against the marginal q(. | evidence) (x_1's law with z
unseen; :class:`FirstMarginal`, read only when its test asks), the later ones against
q(. | z): given x_1, z follows its posterior, independently of the target.

Resume policies for the emitted correction / bonus token:

* ``condition`` (default): keep it as the next cycle's pending token (no extra pass; every
  cycle emits s + 1 tokens). Exact for greedy and sampling.
* ``recompute``: keep it and run one extra trunk pass on it for its state. Exact.
* ``drop``: the paper's Alg. 2: drop it when s >= 1 and redraft from e_{t+s} (the next
  cycle re-verifies that position); when s = 0 keep it and recompute. Exact for greedy
  only; biased for sampling (target p = (1/2, 1/2), a draft that always proposes A:
  P(A) = 3/4 at the second position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.engine import categorical
from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, emit
from mtpc.decoding.verify import verify_greedy, verify_sampling_lazy

Drafter = Callable[[CircuitParams, Tensor | None, int], Tensor]
"""Test hook: ``(params, evidence (1, m) or None, position) -> window (1, n)``, where
``position`` is the index (among prompt + generated ids) of the window's first token."""


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
        self._lap = lap or (lambda section: None)
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
            self._lap("circuit")
            self._sum_logw = self.head.sum_log_weights(self.features)
            self._lap("head")
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
        self._lap("circuit")
        out = self.head.input_logits(self.features, positions, units).float()
        self._lap("head")
        return out

    def token_logits(self, evidence: Tensor) -> Tensor:
        """Every unit's unnormalised, untempered logit at the evidence tokens ``(1, pre, r)``
        (fp32): r d-vectors of W per position, no normaliser."""
        self._lap("circuit")
        positions = torch.arange(evidence.shape[1], device=evidence.device)
        out = self.head.token_logits(self.features, positions, evidence[0]).float()
        self._lap("head")
        return out

    def params(self) -> CircuitParams:
        """theta_t with the whole (1, n, r, V) table (the full-table modes), computed once."""
        if self._params is None:
            self._lap("circuit")
            params = self.model.draft_params(self.hidden)
            self._params = CircuitParams(self._tempered(params.input_logp), params.sum_logw)
            self._lap("head")
        return self._params


@dataclass
class Draft:
    """A drafted window and what verifying it needs.

    Attributes:
        window: ``(1, n)``: the evidence (the pending token, if any), then the m drafts.
        token_probs: ``(m,)`` the proposal's probability of each drafted token, the q_i of
            the acceptance ratio p_i / q_i, or ``i -> q_i(x_i)`` computed on demand (None
            when not asked for: greedy).
        proposal: ``i -> (V,)`` the full proposal q_i(.) at the i-th draft, called at most
            once, at the first rejection (for the residual); None when greedy.
    """

    window: Tensor
    token_probs: Tensor | Callable[[int], float] | None = None
    proposal: Callable[[int], Tensor] | None = None


class MarginalProposal:
    """The circuit's exact conditionals q(x_i | x_<i) of a drafted window, computed lazily.

    q_i needs every unit's leaf at the positions up to i (the latents' posterior given the
    prefix). Those rows are read only when a test asks for q_i: ``verify_sampling_lazy`` asks
    where u_i >= p_i(x_i) only, and stops at the first rejection, whose residual needs the
    full conditional there (the same rows).

    Args:
        state: the head at the drafting state.
        window: ``(1, n)`` the evidence then the drafts.
        pre: evidence positions.
        rows: ``(1, k, r, V)`` normalised leaves of the first k positions if already read.
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
    """One draft: the window and, when ``sampling``, the proposal verification needs.

    Args:
        state: the head at the last processed state.
        evidence: ``(1, pre)`` the pending token, or None.
        mode: the internal mode of a drafting choice (``mtpc.decoding.settings``; the
            table of the public names ``draft`` / ``proposal``: docs/DECODING.md,
            "Drafting"); sampling needs ``sample``, ``zsample`` or ``zsample1``.
        generator: RNG for the sampling modes.
        sampling: also return the proposal (token probabilities and the full proposal).
    """
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
        # greedy: score the units by their logit at the pending token without the
        # normalisers (r d-vectors of W, not r rows); any draft is exact when greedy, and
        # the acceptance measured the same (docs/BENCHMARKS.md)
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
        # (z, x_1) is an ancestral draw, so x_1's distribution is the marginal q(. | evidence)
        # and z given x_1 is the posterior: verify x_1 against the marginal (computed only
        # when the test or the residual asks), the later drafts against q(. | z)
        first = FirstMarginal(MarginalProposal(state, window, pre, rows), probs, tokens)
        return Draft(window, first.token_prob, first.dist)
    return Draft(window, probs.gather(1, tokens[:, None])[:, 0], probs.__getitem__)


def resume(
    model: Any,
    caches: Any,
    kept: Tensor,
    token: int,
    policy: str,
    drop: bool,
    dropped_logits: Tensor,
    kept_logits: Tensor,
    res: GenerationResult,
) -> tuple[Tensor, int | None, Tensor]:
    """After a cycle's verdict, apply the resume policy to the emitted correction / bonus.

    Args:
        model: an ``MTPCModel``; caches: its ``Caches``, already compacted to ``kept``.
        kept: ``(1, K, d)`` trunk states of the kept positions.
        token: the emitted correction / bonus.
        policy: ``condition``, ``recompute`` or ``drop``; ``drop``: drop it this cycle.
        dropped_logits: ``(1, V)`` the target after the last accepted draft (used on a drop).
        kept_logits: ``(1, V)`` the target's next distribution so far (kept when pending).
        res: counts the extra trunk pass.

    Returns:
        The states the draft tail runs on ``(1, K', d)``, the pending token (or None) and the
        target's logits for the next window's first position ``(1, V)``.
    """
    if drop:  # the paper's Alg. 2: redraft from e_{t+s}; the next cycle re-verifies the token
        return kept, None, dropped_logits
    if policy == "condition":
        return kept, token, kept_logits
    # recompute (and drop after s = 0): one extra pass for the kept token's state
    ids = torch.tensor([[token]], device=kept.device)
    extra = model.trunk(ids, caches.trunk)  # (1, 1, d)
    logits = model.verifier_logits(model.verifier_tail(extra, caches.verifier)[:, -1])  # (1, V)
    res.trunk_passes += 1
    return torch.cat([kept, extra], 1), None, logits


class FirstMarginal:
    """``zsample1``'s proposal: the marginal q(. | evidence) at the first draft (the
    :class:`MarginalProposal`'s, computed on demand), then q(. | z) at the later drafts.

    Args:
        marginal: the window's marginal proposal (asked at draft 0 only).
        probs: ``(m, V)`` q(. | z) at the drafts.
        tokens: ``(m,)`` the drafts.
    """

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


@torch.no_grad()
def speculative_generate(
    model: Any, prompt: Tensor, request: Request, drafter: Drafter | None = None
) -> GenerationResult:
    """Self-speculative decoding with one trunk pass per cycle.

    Args:
        model: an ``MTPCModel``.
        prompt: (1, T) ids on the model's device.
        request: checked arguments (``mtpc.decoding.common.check_request``).
        drafter: optional test hook replacing the circuit draft (see :data:`Drafter`).

    Returns:
        A :class:`GenerationResult`.
    """
    circuit = model.head.circuit
    n = circuit.window
    device = model.backbone.device
    generator = torch.Generator(device=device).manual_seed(request.seed)
    rule = TargetRule(request, model.backbone.vocab_size, device)
    greedy, policy, mode = request.greedy, request.policy, request.draft_rule
    draft_temp = None if greedy else request.temperature
    sampled = not greedy and not request.max_throughput  # verification needs the proposal
    caches = model.new_caches()
    clock = Stopwatch(device, request.profile)
    length = prompt.shape[1]  # ids processed or pending

    # --- prefill: every prompt token; keep p(x_{T+1}) and theta_T
    hidden = model.trunk(prompt, caches.trunk)  # (1, T, d)
    kept_logits = model.verifier_logits(
        model.verifier_tail(hidden, caches.verifier)[:, -1]
    )  # (1, V)
    state = HeadState(model, model.draft_tail(hidden, caches.draft)[:, -1], draft_temp, clock.lap)
    pending: int | None = None  # the kept correction / bonus not yet processed
    res = GenerationResult(
        tokens=[],
        method="speculative",
        policy=policy,
        draft_rule=mode,
        draft=request.draft,
        proposal=request.proposal,
        prefill_seconds=clock.split(),
    )
    out = res.tokens

    while True:
        # --- draft: the window's first position is the pending token when there is one
        evidence = None if pending is None else torch.tensor([[pending]], device=device)
        pre = 0 if pending is None else 1
        window_start = length - pre
        if drafter is not None:
            drafted = drafter(state.params(), evidence, window_start)  # (1, n)
            draft = MarginalProposal(state, drafted, pre).draft() if sampled else None
        else:
            draft = draft_step(state, evidence, mode, generator, sampling=sampled)
            drafted = draft.window  # (1, n)
        # what one pass verifies exactly (EVA: up to its window boundary); w <= n
        w = model.backbone.one_pass_span(len(caches.trunk), n)
        window = drafted[:, :w]  # (1, w)
        drafts = window[0, pre:]  # (m,)
        m = w - pre
        clock.lap("circuit")

        # --- verify: one pass of trunk + verifier tail over the window
        base = len(caches.trunk)
        hidden = model.trunk(window, caches.trunk)  # (1, w, d)
        logits = model.verifier_logits(model.verifier_tail(hidden, caches.verifier))[0]  # (w, V)
        res.trunk_passes += 1
        target = logits if pre else torch.cat([kept_logits, logits])  # (m + 1, V)
        clock.lap("model")
        if request.max_throughput:
            s, token = m, rule.pick(target[m], generator)
        elif greedy:
            verdict = verify_greedy(rule.argmax(target), drafts)
            s, token = verdict.accepted, verdict.next_token
        else:
            p = rule.probs(target)  # (m + 1, V)
            assert draft is not None and draft.token_probs is not None and draft.proposal
            q_tokens = draft.token_probs
            if isinstance(q_tokens, torch.Tensor):
                q_tokens = q_tokens[:m]  # (m,) the verified drafts' q
            verdict = verify_sampling_lazy(p, q_tokens, drafts, draft.proposal, generator)
            s, token = verdict.accepted, verdict.next_token
        clock.lap("verify")

        # --- emit
        keep = pre + s  # window positions whose states stay in the caches
        drop = policy == "drop" and s >= 1 and not request.max_throughput
        new = drafts[:s].tolist() + ([] if drop else [token])
        count, stopped = emit(out, new, request, ignore_stops=request.suppress_eos)
        res.accepted.append(s)
        res.emitted.append(count)
        res.drafted.append(m)
        res.offsets.append(pre)
        length += count
        if stopped or len(out) >= request.max_new_tokens:
            res.stopped = stopped
            res.cycle_seconds.append(clock.split())
            break

        # --- crop rejected positions, run the draft tail on the kept states
        if keep < w:
            caches.trunk.crop(base + keep)
            caches.verifier.crop(base + keep)
        clock.lap("cache")
        # p(x_{t+s+1}) after a drop: re-verified next cycle
        kept, pending, kept_logits = resume(
            model,
            caches,
            hidden[:, :keep],
            token,
            policy,
            drop,
            target[s : s + 1],
            kept_logits,
            res,
        )
        if kept.shape[1]:
            last = model.draft_tail(kept, caches.draft)[:, -1]  # (1, d)
            clock.lap("model")
            state = HeadState(model, last, draft_temp, clock.lap)
        clock.lap("cache")
        res.cycle_seconds.append(clock.split())

    res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
    res.breakdown = clock.breakdown(sum(res.cycle_seconds))
    return res
