"""The doors :func:`parse_eval` and :func:`parse_regenerate`: the config read once
(``mtpc.evaluation.settings``) and checked before anything loads, a bad field refused in one
line naming it and the allowed values."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mtpc.config import ConfigError, validate_eval_config, validate_regenerate_config
from mtpc.decoding.settings import CONFIG, SettingsError, Spelling, check_drafting, check_settings
from mtpc.errors import UserError
from mtpc.evaluation.drafters import FIXTURE_PREFIX, FIXTURES
from mtpc.evaluation.drafting import check_eval_drafting, tree_budgets
from mtpc.evaluation.settings import Drafter, EvalSettings, RegenerateSettings, SpecBench

RESUME = ("auto", "force", "never")
"""``resume=``'s values (configs/eval.yaml, docs/EVALUATION.md)."""


class EvalConfigError(UserError, ValueError):
    """An evaluation setting outside what the evaluator accepts; names the field."""


def parse_eval(cfg: Any) -> EvalSettings:
    """``evaluate``'s door (``mtpc.config.validate_eval_config`` checks the target, data and
    counts first: ``ConfigError``; then the evaluator's fields: ``EvalConfigError``)."""
    validate_eval_config(cfg)
    settings = EvalSettings.from_cfg(cfg)
    check_eval_settings(settings)
    return settings


def parse_regenerate(cfg: Any) -> RegenerateSettings:
    """``regenerate``'s door: the config checked (a bad field: ``ConfigError``) and read once,
    before anything loads."""
    validate_regenerate_config(cfg)
    settings = RegenerateSettings.from_cfg(cfg)
    try:  # the engine as mtpc.generate checks it (its method: autoregressive without draft=)
        check_settings(CONFIG, method=settings.decoder.method, compile=settings.decoder.compile)
    except SettingsError as err:
        raise ConfigError(str(err)) from None
    check_batch_size(settings.batch_size, ConfigError)
    check_batch_backbone(settings.batch_size, settings.model.name, ConfigError)
    return settings


def check_batch_size(value: Any, error: type[Exception]) -> None:
    """``batch_size``: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(
            f"batch_size={value!r} is not allowed; allowed: an integer >= 1 "
            "(1: one prompt at a time, the paper's protocol)"
        )


def check_batch_backbone(batch_size: int, model: Any, error: type[Exception]) -> None:
    """``batch_size`` > 1 needs a backbone with a batched cache (not EvaByte's); ``model``: its
    name (before it loads) or the loaded model."""
    if isinstance(model, str):
        batched, name = model != "evabyte", f"model={model}"
    else:
        batched, name = model.backbone.supports_batch, type(model.backbone).__name__
    if batch_size > 1 and not batched:
        raise error(
            f"batch_size={batch_size} is not allowed for {name}: it decodes one prompt at a "
            "time (EvaByte's EVA window cache holds one sequence); allowed: batch_size=1"
        )


DECODING_FIELDS = ("policy", "greedy", "temperature", "top_k", "top_p")
"""The fields :func:`mtpc.decoding.settings.check_settings` checks (``seed`` and
``max_new_tokens``: ``mtpc.config.validate_eval_config``)."""


def check_eval_fields(cfg: Any) -> None:
    """Checks the evaluator's own fields of ``cfg`` (:func:`check_eval_settings`)."""
    check_eval_settings(EvalSettings.from_cfg(cfg))


def _choice(field: str, value: Any, allowed: Sequence[Any], optional: bool = False) -> None:
    if optional and value is None:
        return
    if value not in allowed:
        raise EvalConfigError(
            f"{field}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}"
        )


def _integer(field: str, value: Any, low: int, null: bool = False) -> None:
    """An optional integer >= ``low``; ``null``: the message says that null is allowed too."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        allowed = f"null or an integer >= {low}" if null else f"an integer >= {low}"
        raise EvalConfigError(f"{field}={value!r} is not allowed; allowed: {allowed}")


def _names(value: Any) -> bool:
    """``value`` is null, a name or a non-empty list of names."""
    return (
        value is None
        or isinstance(value, str)
        or (isinstance(value, list) and bool(value) and all(isinstance(x, str) for x in value))
    )


def check_eval_settings(s: EvalSettings) -> None:
    """Checks the evaluator's own fields (beyond ``mtpc.config.validate_eval_config``); the
    decoding ones through :func:`mtpc.decoding.settings.check_settings`, as ``mtpc.generate``
    does, so a bad one gets the same one line."""
    d, run = s.decoding, s.run
    _choice("suppress_eos", d.suppress_eos, (True, False))
    _choice("max_throughput", run.max_throughput, (True, False))
    _choice("english_only", s.prompts.english_only, (True, False))
    _choice("plots", s.output.plots, (True, False))
    _choice("progress", run.progress, (True, False), optional=True)
    _choice("warmup_window", run.warmup_window, (True, False), optional=True)
    _choice("interleave", run.interleave, (True, False), optional=True)
    _choice("resume", s.output.resume, RESUME, optional=True)
    try:
        check_eval_drafting(d.drafting, d.tree_budget)  # before check_settings: drafting=tree
        given = {f: v for f in DECODING_FIELDS if (v := getattr(d, f)) is not None}
        greedy = check_settings(CONFIG, **given, draft=d.drafting, proposal=d.proposal).greedy
        budget = max(tree_budgets(d.tree_budget), default=0)  # the tree rows' choice
        check_drafting(greedy, tree_budget=budget, tree_floor=d.tree_floor, spell=CONFIG)
        check_settings(CONFIG, method="autoregressive", compile=d.compile)  # the AR pass's
    except SettingsError as err:
        raise EvalConfigError(str(err)) from None
    if d.temperature <= 0:  # a config's temperature is a number > 0 even when greedy ignores it
        raise EvalConfigError(
            f"temperature={d.temperature!r} is not allowed; allowed: a number > 0"
        )
    sources = s.prompts.sources
    if not _names(sources):
        raise EvalConfigError(
            f"sources={sources!r} is not allowed; allowed: null or a list of source names, "
            "e.g. sources=[synthetic/multi_answer]"
        )
    _integer("warmup", run.warmup, 0)
    _integer("num_threads", run.num_threads, 1)
    _integer("max_prompt_length", s.prompts.max_prompt_length, 1)
    check_batch_size(run.batch_size, EvalConfigError)
    check_batch_backbone(run.batch_size, s.model.name, EvalConfigError)
    if run.batch_size > 1 and s.drafter is not None:
        raise EvalConfigError(
            f"batch_size={run.batch_size} is not allowed with drafter= (another vocabulary's "
            "drafter decodes one prompt at a time); allowed: batch_size=1"
        )
    if s.drafter is not None:
        _check_drafter(s.drafter, greedy)
    if s.prompts.spec_bench is not None:
        _check_prompts(s, s.prompts.spec_bench)
    device = str(run.device)
    if device != "cpu" and not device.startswith("cuda"):
        raise EvalConfigError(f"device={device!r} is not allowed; allowed: cpu, cuda, cuda:<i>")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalConfigError(
            f"device={device!r} is not allowed: CUDA is not available; allowed: cpu"
        )


def _check_drafter(drafter: Drafter, greedy: Any) -> None:
    """``drafter.*`` of ``drafter=hetero`` (configs/drafter/hetero.yaml)."""
    hetero = {
        name: value
        for name in ("algorithm", "lookahead", "look_behind", "max_psi_paths", "psi")
        if (value := drafter.fields.get(name)) is not None or name == "algorithm"
    }
    try:
        spell = Spelling(lambda field: f"drafter.{field}", config=True)
        check_settings(spell, greedy=greedy, **hetero)
    except SettingsError as err:
        raise EvalConfigError(str(err)) from None
    model = str(drafter.model)
    allowed = "allowed: a local HF causal-LM folder or " + ", ".join(
        FIXTURE_PREFIX + f for f in FIXTURES
    )
    if model.startswith(FIXTURE_PREFIX) and model.removeprefix(FIXTURE_PREFIX) not in FIXTURES:
        raise EvalConfigError(f"drafter.model={model!r} is not allowed; {allowed}")
    if not model.startswith(FIXTURE_PREFIX) and not Path(model).expanduser().is_dir():
        raise EvalConfigError(f"drafter.model={model!r} does not exist; {allowed}")


def _check_prompts(s: EvalSettings, spec: SpecBench) -> None:
    """``prompts.*`` of ``prompts=spec_bench`` (the file: ``loading.spec_bench_questions``)."""
    from mtpc.data.spec_bench import NAME

    if spec.name != NAME:
        raise EvalConfigError(f"prompts.name={spec.name!r} is not allowed; allowed: {NAME}")
    if not isinstance(spec.path, str) or not spec.path:
        raise EvalConfigError(
            f"prompts.path={spec.path!r} is not allowed; allowed: a Spec-Bench question.jsonl "
            "(prompts=spec_bench prompts.path=<file>)"
        )
    if not _names(spec.categories):
        raise EvalConfigError(
            f"prompts.categories={spec.categories!r} is not allowed; allowed: null or a list of "
            "categories, e.g. prompts.categories=[writing,translation]"
        )
    _integer("prompts.per_category", spec.per_category, 1, null=True)
    _integer("prompts.turns", spec.turns, 1, null=True)
    if s.prompts.sources is not None:
        raise EvalConfigError(
            "sources= is not allowed with prompts=spec_bench (it selects the data group's "
            "sources); allowed: sources=null, and prompts.categories=[...] for Spec-Bench"
        )
    if s.prompts.english_only is True:
        raise EvalConfigError(
            "english_only=true is not allowed with prompts=spec_bench (its questions are taken "
            "as they are); allowed: false, and prompts.categories=[...] to choose questions"
        )
    if s.drafter is not None and spec.turns != 1:
        raise EvalConfigError(
            "drafter=hetero decodes one turn per prompt; with prompts=spec_bench set "
            "prompts.turns=1 (allowed: 1)"
        )
