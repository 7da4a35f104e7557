"""Decoding: autoregressive baseline, exactly lossless self-speculative decoding (docs/DECODING.md).

``generate`` is the entry point (``mtpc.generate``); the algorithms are functions of
(model, prompt, checked request) in ``autoregressive`` and ``speculative``; the verification
rules shared with the heterogeneous-vocabulary decoders are in ``verify``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtpc.decoding.common import (
    DEFAULT_GREEDY_DRAFT_MODE,
    DRAFT_MODES,
    METHODS,
    POLICIES,
    GenerationResult,
    check_request,
    prompt_tensor,
)

__all__ = [
    "DEFAULT_GREEDY_DRAFT_MODE",
    "DRAFT_MODES",
    "METHODS",
    "POLICIES",
    "GenerationResult",
    "generate",
]


def generate(
    model: Any,
    prompt_ids: Any,
    max_new_tokens: int = 64,
    method: str = "speculative",
    greedy: bool = True,
    seed: int = 0,
    policy: str = "condition",
    draft_mode: str | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] | None = None,
    suppress_eos: bool = False,
    max_throughput: bool = False,
    profile: bool = False,
    drafter: Any = None,
) -> GenerationResult:
    """Generates a continuation of one prompt with the target of ``model``.

    The output is the target's: greedy speculative output equals greedy autoregressive
    output token for token; sampled speculative output has the target's distribution
    (policies ``condition`` and ``recompute``; ``drop`` is exact for greedy only).

    Args:
        model: an ``MTPCModel`` (target + draft head; ``autoregressive`` uses the target only).
        prompt_ids: list of ids, or a (T,) / (1, T) tensor (batch size 1).
        max_new_tokens: at most this many new ids (>= 1).
        method: ``speculative`` or ``autoregressive``.
        greedy: argmax decoding (exact match) or sampling (rejection + residual).
        seed: RNG seed (sampling, ancestral drafts).
        policy: what happens to the verifier's correction / bonus token: ``condition``
            (keep it, draft the next window conditioned on it; no extra pass), ``recompute``
            (keep it, one extra trunk pass), ``drop`` (the paper's Alg. 2).
        draft_mode: ``sample``, ``map`` (max-product) or ``chain`` (greedy chain of exact
            conditionals); None: the measured per-family default when greedy
            (:data:`DEFAULT_GREEDY_DRAFT_MODE`), ``sample`` when sampling (required).
        temperature: sampling temperature (> 0), applied to the target and to the draft's
            input units.
        top_k: keep the k most likely target tokens (sampling).
        top_p: nucleus filtering of the target (sampling).
        stop_ids: generation ends after one of these ids; None: the codec's stop ids
            (``model.backbone.codec``); ``()``: never stop early.
        suppress_eos: the target never emits a stop id (fixed-length generation, App. F).
        max_throughput: accept every draft (not lossless; the paper's max tok/s).
        profile: time each section of a cycle (``result.breakdown``).
        drafter: test hook replacing the circuit draft (``speculative.Drafter``).

    Returns:
        A :class:`GenerationResult` (``tokens``, ``accepted``, ``seconds``, per-cycle data).

    Raises:
        ValueError: bad arguments, an empty prompt or one that does not fit the target's
            context (checked before decoding starts).
    """
    prompt = prompt_tensor(model, prompt_ids)
    request = check_request(
        model,
        prompt,
        method=method,
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        seed=seed,
        policy=policy,
        draft_mode=draft_mode,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stop_ids,
        suppress_eos=suppress_eos,
        max_throughput=max_throughput,
        profile=profile,
    )
    was_training = model.training
    if was_training:
        model.eval()
    try:
        if request.method == "autoregressive":
            from mtpc.decoding.autoregressive import autoregressive_generate

            return autoregressive_generate(model, prompt, request)
        from mtpc.decoding.speculative import speculative_generate

        return speculative_generate(model, prompt, request, drafter=drafter)
    finally:
        if was_training:
            model.train()
