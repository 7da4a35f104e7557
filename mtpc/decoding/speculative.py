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

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.params import CircuitParams
from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, emit
from mtpc.decoding.verify import verify_greedy, verify_sampling_lazy

Drafter = Callable[[CircuitParams, Tensor | None, int], Tensor]
"""Test hook: ``(params, evidence (1, m) or None, position) -> window (1, n)``, where
``position`` is the index (among prompt + generated ids) of the window's first token."""


def draft_window(
    circuit: Any,
    params: CircuitParams,
    evidence: Tensor | None,
    mode: str,
    generator: torch.Generator | None,
) -> Tensor:
    """A drafted window (1, n) from the circuit; its first positions equal ``evidence``.

    Args:
        circuit: the head's ``Circuit``.
        params: theta for one state (B = 1).
        evidence: (1, m) fixed first tokens or None.
        mode: ``sample`` (ancestral, exact posterior given the evidence), ``map``
            (max-product) or ``chain`` (greedy chain of exact conditionals).
        generator: RNG for ``sample``.
    """
    if evidence is not None and evidence.shape[1] == circuit.window:
        return evidence
    if mode == "sample":
        return circuit.sample(params, generator=generator, evidence=evidence)
    if mode == "map":
        return circuit.map_decode(params, evidence=evidence)
    return circuit.greedy_chain(params, evidence=evidence)


def _draft_params(model: Any, hidden: Tensor, temperature: float | None) -> CircuitParams:
    """theta of the last state (1, d); the inputs tempered like the target when sampling.

    Tempering the input units is a different (still normalised) circuit q, not the tempered
    joint; any q keeps the output exact, a closer one is accepted more often.
    """
    params = model.draft_params(hidden)
    if temperature is not None and temperature != 1.0:
        logp = torch.log_softmax(params.input_logp / temperature, dim=-1)
        params = CircuitParams(logp, params.sum_logw)
    return params


def _draft_conditional(
    circuit: Any, params: CircuitParams, window: Tensor, pre: int, i: int
) -> Tensor:
    """q(. | x_1..x_{pre+i}) (V,): the draft's full conditional at the i-th verified draft."""
    return circuit.conditional_log_prob(params, window[:, : pre + i])[0].exp()


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
    greedy, policy, mode = request.greedy, request.policy, request.draft_mode
    draft_temp = None if greedy else request.temperature
    caches = model.new_caches()
    clock = Stopwatch(device, request.profile)
    length = prompt.shape[1]  # ids processed or pending

    # --- prefill: every prompt token; keep p(x_{T+1}) and theta_T
    hidden = model.trunk(prompt, caches.trunk)  # (1, T, d)
    kept_logits = model.verifier_logits(
        model.verifier_tail(hidden, caches.verifier)[:, -1]
    )  # (1, V)
    params = _draft_params(model, model.draft_tail(hidden, caches.draft)[:, -1], draft_temp)
    caches.commit()
    pending: int | None = None  # the kept correction / bonus not yet processed
    res = GenerationResult(
        tokens=[],
        method="speculative",
        policy=policy,
        draft_mode=mode,
        prefill_seconds=clock.split(),
    )
    out = res.tokens

    while True:
        # --- draft: the window's first position is the pending token when there is one
        evidence = None if pending is None else torch.tensor([[pending]], device=device)
        pre = 0 if pending is None else 1
        window_start = length - pre
        if drafter is not None:
            window = drafter(params, evidence, window_start)  # (1, n)
        else:
            window = draft_window(circuit, params, evidence, mode, generator)  # (1, n)
        drafts = window[0, pre:]  # (m,)
        m = n - pre
        clock.lap("circuit")

        # --- verify: one pass of trunk + verifier tail over the window
        base = len(caches.trunk)
        hidden = model.trunk(window, caches.trunk)  # (1, n, d)
        logits = model.verifier_logits(model.verifier_tail(hidden, caches.verifier))[0]  # (n, V)
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
            clock.lap("verify")
            prefix = circuit.prefix_log_prob(params, window)[0]  # (n,) log q(x_1..x_{i+1})
            q_tokens = (prefix[pre:] - torch.cat([prefix.new_zeros(1), prefix[:-1]])[pre:]).exp()

            q_at = functools.partial(_draft_conditional, circuit, params, window, pre)
            clock.lap("circuit")
            verdict = verify_sampling_lazy(p, q_tokens, drafts, q_at, generator)
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
        if keep < n:
            caches.trunk.crop(base + keep)
            caches.verifier.crop(base + keep)
        clock.lap("cache")
        kept = hidden[:, :keep]  # (1, keep, d)
        if drop:
            pending, kept_logits = None, target[s : s + 1]  # p(x_{t+s+1}), re-verified next
        elif policy == "condition":
            pending = token
        else:  # recompute (and drop after s = 0): one extra pass for the kept token's state
            extra = model.trunk(torch.tensor([[token]], device=device), caches.trunk)  # (1, 1, d)
            tail = model.verifier_tail(extra, caches.verifier)
            kept_logits = model.verifier_logits(tail[:, -1])  # (1, V)
            kept = torch.cat([kept, extra], 1)
            pending = None
            res.trunk_passes += 1
        if kept.shape[1]:
            state = model.draft_tail(kept, caches.draft)[:, -1]  # (1, d)
            clock.lap("model")
            params = _draft_params(model, state, draft_temp)
            clock.lap("head")
        caches.commit()
        clock.lap("cache")
        res.cycle_seconds.append(clock.split())

    res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
    res.breakdown = clock.breakdown(sum(res.cycle_seconds))
    return res
