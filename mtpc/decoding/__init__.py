"""Decoding: autoregressive baseline, exactly lossless self-speculative decoding (docs/DECODING.md).

``generate`` is the entry point (``mtpc.generate``); the algorithms are functions of
(model, prompt, checked request) in ``autoregressive`` and ``speculative``; the verification
rules shared with the heterogeneous-vocabulary decoders are in ``verify``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mtpc.choices import DRAFTS, METHODS, POLICIES, PROPOSALS
from mtpc.decoding.settings import (
    CHAIN_RULES,
    DEFAULT_GREEDY_DRAFT,
    DEFAULT_SAMPLING_PROPOSAL,
    DecodingSettings,
    DraftRule,
    SettingsError,
    check_settings,
)

if TYPE_CHECKING:
    from torch import Tensor

    from mtpc.decoding.common import GenerationResult, Request

_log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GREEDY_DRAFT",
    "DEFAULT_SAMPLING_PROPOSAL",
    "DRAFTS",
    "METHODS",
    "POLICIES",
    "PROPOSALS",
    "DecodingSettings",
    "DraftRule",
    "GenerationResult",
    "SettingsError",
    "check_settings",
    "generate",
]


def __getattr__(name: str) -> Any:
    if name == "GenerationResult":  # lazily: mtpc.decoding.settings stays torch-free
        from mtpc.decoding.common import GenerationResult

        return GenerationResult
    raise AttributeError(f"module 'mtpc.decoding' has no attribute {name!r}")


def generate(
    model: Any,
    prompt_ids: Any,
    max_new_tokens: int = 64,
    method: str = "speculative",
    greedy: bool = True,
    seed: int = 0,
    policy: str = "condition",
    draft: str | None = None,
    proposal: str | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] | None = None,
    suppress_eos: bool = False,
    max_throughput: bool = False,
    profile: bool = False,
    drafter: Any = None,
    tree_budget: int | None = None,
    tree_floor: float = 0.0,
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
        draft: what a cycle drafts: ``path`` | ``map`` | ``chain`` | ``tree`` (with
            ``tree_budget``); None: the measured default. The one table of the choices:
            docs/DECODING.md, "Drafting".
        proposal: sampling: what the drafts are verified against: ``path`` |
            ``first_marginal`` | ``marginal``; None: the family's measured default.
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
        tree_budget: nodes per token tree (``draft=tree``, implied when ``draft`` is None);
            0 or None: a chain. A backbone without tree attention falls back to the chain,
            with a log line; EvaByte's trees stop at the current EVA window's end.
        tree_floor: token trees: leave out nodes whose draft probability q(path) is below
            it (adaptive tree size); in [0, 1); needs a ``tree_budget``.

    Returns:
        A :class:`GenerationResult` (``tokens``, ``accepted``, ``seconds``, per-cycle data).

    Raises:
        ValueError: bad arguments, an empty prompt or one that does not fit the target's
            context (checked before decoding starts).
    """
    from mtpc.decoding.common import check_request, prompt_tensor

    stops = None if stop_ids is None else tuple(stop_ids)
    settings = check_settings(  # model-free: the same refusals as generate_hetero, evaluate
        method=method, max_new_tokens=max_new_tokens, greedy=greedy, seed=seed, policy=policy,
        draft=draft, proposal=proposal, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_ids=stops, suppress_eos=suppress_eos, max_throughput=max_throughput,
        profile=profile, tree_budget=tree_budget, tree_floor=tree_floor,
    )  # fmt: skip
    prompt = prompt_tensor(model, prompt_ids)
    request = check_request(model, prompt, settings)
    if request.tree_budget and drafter is not None:
        raise ValueError("drafter (a chain test hook) is not allowed with tree_budget > 0")
    return _decode(model, prompt, _chain_without_tree_attention(model, request), drafter)


def _chain_without_tree_attention(model: Any, request: Request) -> Request:
    """A tree request on a backbone without tree attention: its chain (the same draft rule),
    with a log line; exact either way."""
    if not request.tree_budget or model.backbone.supports_tree_mask:
        return request
    _log.warning(
        "tree_budget=%d: %s has no tree attention; verifying the chain instead (exact)",
        request.tree_budget,
        type(model.backbone).__name__,
    )
    chain = next(c for c, rule in CHAIN_RULES.items() if rule == request.draft_rule)
    return dataclasses.replace(request, tree_budget=0, draft=chain[0], proposal=chain[1])


def _decode(model: Any, prompt: Tensor, request: Request, drafter: Any) -> GenerationResult:
    """Runs the request's decoder on ``model`` in eval mode (restoring training mode)."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        if request.method == "autoregressive":
            from mtpc.decoding.autoregressive import autoregressive_generate

            return autoregressive_generate(model, prompt, request)
        if request.tree_budget:
            from mtpc.decoding.tree import tree_generate

            return tree_generate(model, prompt, request)
        from mtpc.decoding.speculative import speculative_generate

        return speculative_generate(model, prompt, request, drafter=drafter)
    finally:
        if was_training:
            model.train()
