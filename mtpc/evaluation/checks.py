"""Evaluation settings checked before anything loads: one line naming the field and the
allowed values (``check_eval_fields``; the drafting choice: ``mtpc.evaluation.drafting``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpc.decoding.settings import (
    CONFIG,
    SettingsError,
    Spelling,
    check_drafting,
    check_settings,
)
from mtpc.errors import UserError
from mtpc.evaluation.drafters import FIXTURE_PREFIX, FIXTURES
from mtpc.evaluation.drafting import check_eval_drafting, tree_budgets

logger = logging.getLogger(__name__)


RESUME = ("auto", "force", "never")
"""``resume=``: resume a folder of the same evaluation (refusing another's), resume anyway, or
decode afresh into a new folder (``<folder>-2``, ``-3``, ...), leaving the old one untouched."""


class EvalConfigError(UserError, ValueError):
    """An evaluation setting outside what the evaluator accepts; names the field."""


def get_field(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s field ``key`` (dotted) of a config or a plain mapping; ``default`` if missing."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=default)
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


DECODING_FIELDS = ("policy", "greedy", "temperature", "top_k", "top_p", "seed", "max_new_tokens")
"""The evaluation's fields checked by :func:`mtpc.decoding.settings.check_settings` (with the
chain's ``drafting`` and ``proposal``; the tree rows' ``tree_budget`` and ``tree_floor`` by
:func:`mtpc.decoding.settings.check_drafting`)."""


def check_eval_fields(cfg: Any) -> None:
    """Checks the evaluator's own fields (beyond ``mtpc.config.validate_eval_config``).

    The decoding settings go through :func:`mtpc.decoding.settings.check_settings`, as
    ``mtpc.generate`` and ``mtpc.generate_hetero`` do: a bad one gets the same one line.
    """

    def choice(field: str, allowed: Sequence[Any], optional: bool = False) -> None:
        value = get_field(cfg, field)
        if optional and value is None:
            return
        if value not in allowed:
            raise EvalConfigError(
                f"{field}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}"
            )

    for field in ("suppress_eos", "max_throughput", "english_only", "plots", "progress",
                  "warmup_window", "interleave"):  # fmt: skip
        choice(field, (True, False), optional=field in ("progress", "warmup_window", "interleave"))
    choice("resume", RESUME, optional=True)
    drafting, budgets = get_field(cfg, "drafting"), plain(get_field(cfg, "tree_budget"))
    try:
        check_eval_drafting(drafting, budgets)  # before check_settings: drafting=tree
        given = {f: v for f in DECODING_FIELDS if (v := get_field(cfg, f)) is not None}
        greedy = check_settings(
            CONFIG, **given, draft=drafting, proposal=get_field(cfg, "proposal")
        ).greedy
        floor = get_field(cfg, "tree_floor")  # the tree rows' choice
        budget = max(tree_budgets(budgets), default=0)
        floor = 0.0 if floor is None else floor
        check_drafting(greedy, tree_budget=budget, tree_floor=floor, spell=CONFIG)
    except SettingsError as err:
        raise EvalConfigError(str(err)) from None
    temperature = get_field(cfg, "temperature", 1.0)
    if temperature <= 0:  # a config's temperature is a number > 0 even when greedy ignores it
        raise EvalConfigError(f"temperature={temperature!r} is not allowed; allowed: a number > 0")
    sources = plain(get_field(cfg, "sources"))
    if sources is not None and not (
        isinstance(sources, str)
        or (isinstance(sources, list) and sources and all(isinstance(x, str) for x in sources))
    ):
        raise EvalConfigError(
            f"sources={sources!r} is not allowed; allowed: null or a list of source names, "
            "e.g. sources=[synthetic/multi_answer]"
        )
    for field, low in (("warmup", 0), ("num_threads", 1), ("max_prompt_length", 1)):
        value = get_field(cfg, field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < low
        ):
            raise EvalConfigError(f"{field}={value!r} is not allowed; allowed: an integer >= {low}")
    if get_field(cfg, "drafter") is not None:
        _check_drafter(cfg, greedy)
    if get_field(cfg, "prompts") is not None:
        _check_prompts(cfg)
    device = str(get_field(cfg, "device", "cpu"))
    if device != "cpu" and not device.startswith("cuda"):
        raise EvalConfigError(f"device={device!r} is not allowed; allowed: cpu, cuda, cuda:<i>")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalConfigError(
            f"device={device!r} is not allowed: CUDA is not available; allowed: cpu"
        )


def _check_drafter(cfg: Any, greedy: Any) -> None:
    """``drafter.*`` of ``drafter=hetero`` (configs/drafter/hetero.yaml)."""
    hetero = {
        field: value
        for field in ("algorithm", "lookahead", "look_behind", "max_psi_paths", "psi")
        if (value := get_field(cfg, f"drafter.{field}")) is not None or field == "algorithm"
    }
    try:
        spell = Spelling(lambda field: f"drafter.{field}", config=True)
        check_settings(spell, greedy=greedy, **hetero)
    except SettingsError as err:
        raise EvalConfigError(str(err)) from None
    model = str(get_field(cfg, "drafter.model"))
    if model.startswith(FIXTURE_PREFIX) and model[len(FIXTURE_PREFIX) :] not in FIXTURES:
        raise EvalConfigError(
            f"drafter.model={model!r} is not allowed; allowed: a local HF causal-LM folder or "
            + ", ".join(FIXTURE_PREFIX + f for f in FIXTURES)
        )
    if not model.startswith(FIXTURE_PREFIX) and not Path(model).expanduser().is_dir():
        raise EvalConfigError(
            f"drafter.model={model!r} does not exist; allowed: a local HF causal-LM folder or "
            + ", ".join(FIXTURE_PREFIX + f for f in FIXTURES)
        )


def _check_prompts(cfg: Any) -> None:
    """``prompts.*`` of ``prompts=spec_bench`` (configs/prompts/spec_bench.yaml); the file
    itself is read by ``mtpc.evaluation.loading.spec_bench_questions``."""
    from mtpc.data.spec_bench import NAME

    name = get_field(cfg, "prompts.name")
    if name != NAME:
        raise EvalConfigError(f"prompts.name={name!r} is not allowed; allowed: {NAME}")
    path = get_field(cfg, "prompts.path")
    if not isinstance(path, str) or not path:
        raise EvalConfigError(
            f"prompts.path={path!r} is not allowed; allowed: a Spec-Bench question.jsonl "
            "(prompts=spec_bench prompts.path=<file>)"
        )
    categories = plain(get_field(cfg, "prompts.categories"))
    if categories is not None and not (
        isinstance(categories, str)
        or (
            isinstance(categories, list)
            and categories
            and all(isinstance(c, str) for c in categories)
        )
    ):
        raise EvalConfigError(
            f"prompts.categories={categories!r} is not allowed; allowed: null or a list of "
            "categories, e.g. prompts.categories=[writing,translation]"
        )
    for field in ("prompts.per_category", "prompts.turns"):
        value = get_field(cfg, field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise EvalConfigError(
                f"{field}={value!r} is not allowed; allowed: null or an integer >= 1"
            )
    if plain(get_field(cfg, "sources")) is not None:
        raise EvalConfigError(
            "sources= is not allowed with prompts=spec_bench (it selects the data group's "
            "sources); allowed: sources=null, and prompts.categories=[...] for Spec-Bench"
        )
    if get_field(cfg, "english_only") is True:
        raise EvalConfigError(
            "english_only=true is not allowed with prompts=spec_bench (its questions are taken "
            "as they are); allowed: false, and prompts.categories=[...] to choose questions"
        )
    if get_field(cfg, "drafter") is not None and get_field(cfg, "prompts.turns") != 1:
        raise EvalConfigError(
            "drafter=hetero decodes one turn per prompt; with prompts=spec_bench set "
            "prompts.turns=1 (allowed: 1)"
        )


def plain(value: Any) -> Any:
    """``value`` as plain Python (a config node resolved to dicts and lists)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value
