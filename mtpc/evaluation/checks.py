"""Evaluation settings checked before anything loads: one line naming the field and the
allowed values (``check_eval_fields``; the drafting choice: ``mtpc.evaluation.drafting``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpc.decoding import POLICIES
from mtpc.decoding.settings import SettingsError
from mtpc.errors import UserError
from mtpc.evaluation.drafting import check_drafting

logger = logging.getLogger(__name__)


RESUME = ("auto", "force", "never")
"""``resume=``: resume a folder of the same evaluation (refusing another's), resume anyway, or
decode afresh into a new folder (``<folder>-2``, ``-3``, ...), leaving the old one untouched."""


class EvalConfigError(UserError, ValueError):
    """An evaluation setting outside what the evaluator accepts; names the field."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=default)
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def check_eval_fields(cfg: Any) -> None:
    """Checks the evaluator's own fields (beyond ``mtpc.config.validate_eval_config``)."""

    def choice(field: str, allowed: Sequence[Any], optional: bool = False) -> None:
        value = _get(cfg, field)
        if optional and value is None:
            return
        if value not in allowed:
            raise EvalConfigError(
                f"{field}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}"
            )

    choice("policy", POLICIES)
    for field in ("greedy", "suppress_eos", "max_throughput", "english_only", "plots", "progress",
                  "warmup_window"):  # fmt: skip
        choice(field, (True, False), optional=field in ("progress", "warmup_window"))
    choice("resume", RESUME, optional=True)
    try:
        check_drafting(
            _get(cfg, "greedy", True),
            _get(cfg, "drafting"),
            _get(cfg, "proposal"),
            _get(cfg, "draft_mode"),
            _plain(_get(cfg, "tree_budget")),
            _get(cfg, "tree_floor", 0.0),
        )
    except SettingsError as err:  # in the config's own spelling of booleans
        message = str(err).replace("greedy=False", "greedy=false").replace("=True", "=true")
        raise EvalConfigError(message) from None
    sources = _plain(_get(cfg, "sources"))
    if sources is not None and not (
        isinstance(sources, str)
        or (isinstance(sources, list) and sources and all(isinstance(x, str) for x in sources))
    ):
        raise EvalConfigError(
            f"sources={sources!r} is not allowed; allowed: null or a list of source names, "
            "e.g. sources=[synthetic/multi_answer]"
        )
    integers = (
        ("warmup", 0),
        ("num_threads", 1),
        ("top_k", 1),
        ("max_prompt_length", 1),
        ("drafter.lookahead", 1),  # drafter=hetero; absent (None) otherwise
        ("drafter.look_behind", 0),
        ("drafter.max_psi_paths", 1),
    )
    for field, low in integers:
        value = _get(cfg, field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < low
        ):
            raise EvalConfigError(f"{field}={value!r} is not allowed; allowed: an integer >= {low}")
    temperature = _get(cfg, "temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or temperature <= 0
    ):
        raise EvalConfigError(f"temperature={temperature!r} is not allowed; allowed: a number > 0")
    top_p = _get(cfg, "top_p")
    if top_p is not None and (not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise EvalConfigError(f"top_p={top_p!r} is not allowed; allowed: a number in (0, 1]")
    if _get(cfg, "drafter") is not None:
        _check_drafter(cfg, choice)
    device = str(_get(cfg, "device", "cpu"))
    if device != "cpu" and not device.startswith("cuda"):
        raise EvalConfigError(f"device={device!r} is not allowed; allowed: cpu, cuda, cuda:<i>")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalConfigError(
            f"device={device!r} is not allowed: CUDA is not available; allowed: cpu"
        )


def _check_drafter(cfg: Any, choice: Any) -> None:
    """``drafter.*`` of ``drafter=hetero`` (configs/drafter/hetero.yaml)."""
    from mtpc.decoding.hetero import ALGORITHMS, PSI_METHODS
    from mtpc.evaluation.hetero import FIXTURE_PREFIX, FIXTURES

    choice("drafter.algorithm", ALGORITHMS)
    choice("drafter.psi", PSI_METHODS, optional=True)
    model = str(_get(cfg, "drafter.model"))
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


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value
