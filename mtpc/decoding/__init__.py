"""Decoding: the AR baseline and exactly lossless self-speculative decoding; ``generate`` is
``mtpc.generate``. See docs/DECODING.md, "API".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

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


@overload
def generate(
    model: Any, prompt_ids: list[list[int]] | list[Tensor], *args: Any, **kwargs: Any
) -> list[GenerationResult]: ...


@overload
def generate(
    model: Any, prompt_ids: Sequence[int] | Tensor, *args: Any, **kwargs: Any
) -> GenerationResult: ...


def generate(
    model: Any,
    prompt_ids: Any,
    max_new_tokens: int = 64,
    method: str = "speculative",
    greedy: bool = True,
    seed: int | Sequence[int] = 0,
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
    batch_size: int | None = None,
    compile: bool | str = False,
) -> GenerationResult | list[GenerationResult]:
    """Generates a continuation of one prompt (ids, or a (T,) / (1, T) tensor), or of each of
    a list of prompts (then a list of results, in order), with the target of ``model``.

    The output is the target's: greedy, token for token; sampled, in distribution (``drop`` is
    exact for greedy only). The arguments, the result and the refusals (ValueError, before
    any decoding): docs/DECODING.md, "API", "Drafting" and "Many prompts at once"; ``drafter``
    is a test hook replacing the circuit draft (``speculative.Drafter``). ``compile``: True
    (or a torch.compile backend name) runs the static, compiled decode step
    (docs/DECODING.md, "Compiled decoding"; ``GenerationResult.engine`` says what ran).
    """
    many = is_prompt_list(prompt_ids)
    items = list(prompt_ids) if many else [prompt_ids]
    seeds = check_seeds(seed, len(items))
    settings = check_settings(  # model-free: the same refusals as generate_hetero, evaluate
        method=method, max_new_tokens=max_new_tokens, greedy=greedy, seed=seeds[0],
        policy=policy, draft=draft, proposal=proposal, temperature=temperature, top_k=top_k,
        top_p=top_p, stop_ids=None if stop_ids is None else tuple(stop_ids),
        suppress_eos=suppress_eos, max_throughput=max_throughput, profile=profile,
        tree_budget=tree_budget, tree_floor=tree_floor, compile=compile,
    )  # fmt: skip
    prompts, requests = checked_prompts(model, items, settings, seeds, many)
    if settings.compile:
        from mtpc.decoding.static import supports_compile

        refusal = supports_compile(model, compile)
        if refusal is not None:
            raise ValueError(refusal)
    if requests[0].tree_budget and drafter is not None:
        raise ValueError("drafter (a chain test hook) is not allowed with tree_budget > 0")
    from mtpc.backbones import check_batch_size  # torch: not at the settings' import

    out = _decode(
        model, prompts, requests, drafter, check_batch_size(batch_size, model.backbone, len(items))
    )
    return out if many else out[0]


def checked_prompts(
    model: Any, items: Sequence[Any], settings: DecodingSettings, seeds: list[int], many: bool
) -> tuple[list[Tensor], list[Request]]:
    """Each prompt as ``(T,)`` ids and its request (its seed, checked for the model)."""
    from mtpc.decoding.common import check_request, prompt_tensor

    prompts, requests = [], []
    for i, item in enumerate(items):
        prompt = prompt_tensor(model, item, f"prompt_ids[{i}]" if many else "prompt_ids")
        request = dataclasses.replace(settings, seed=seeds[i])
        requests.append(_chain_without_tree_attention(model, check_request(model, prompt, request)))
        prompts.append(prompt[0])  # (T,)
    return prompts, requests


def is_prompt_list(prompt_ids: Any) -> bool:
    """A list of prompts (lists or tensors), not one prompt's ids."""
    return isinstance(prompt_ids, list | tuple) and any(
        not isinstance(p, int) and hasattr(p, "__len__") for p in prompt_ids
    )


def check_seeds(seed: Any, count: int) -> list[int]:
    """One seed per prompt: ``seed`` for all, or a list of ``count``."""
    if isinstance(seed, list | tuple):
        if len(seed) != count:
            raise ValueError(
                f"seed has {len(seed)} values for {count} prompts; allowed: one "
                "int, or one per prompt"
            )
        return [int(check_settings(seed=s).seed) for s in seed]
    return [seed] * count


def _chain_without_tree_attention(model: Any, request: Request) -> Request:
    """A tree request on a backbone without tree attention: its chain (same draft rule)."""
    if not request.tree_budget or model.backbone.supports_tree_mask:
        return request
    _log.warning(
        "tree_budget=%d: %s has no tree attention; verifying the chain instead (exact)",
        request.tree_budget,
        type(model.backbone).__name__,
    )
    chain = next(c for c, rule in CHAIN_RULES.items() if rule == request.draft_rule)
    return dataclasses.replace(request, tree_budget=0, draft=chain[0], proposal=chain[1])


def _decode(
    model: Any, prompts: list[Tensor], requests: list[Request], drafter: Any, size: int
) -> list[GenerationResult]:
    """Runs the requests' decoder on ``model`` in eval mode (restoring training mode): the
    autoregressive ``step`` or a proposer (a chain or a token tree) in ``loop.decode``, or
    with ``compile`` (and EvaByte's batches, uncompiled) in ``static.decode_static``."""
    from mtpc.decoding import autoregressive
    from mtpc.decoding.loop import decode
    from mtpc.decoding.speculative import Chain
    from mtpc.decoding.tree import Tree

    was_training = model.training
    if was_training:
        model.eval()
    request = requests[0]
    try:
        step = autoregressive.step if request.method == "autoregressive" else None
        proposer: Any = None
        if step is None:
            proposer = Tree(request) if request.tree_budget else Chain(request, drafter)
        from mtpc.decoding.static import StaticEngine, decode_static, engine_class

        if request.compile or (size > 1 and engine_class(model) is not StaticEngine):
            return decode_static(model, prompts, requests, size, step=step, proposer=proposer)
        return decode(model, prompts, requests, proposer, size, step=step)
    finally:
        if was_training:
            model.train()
