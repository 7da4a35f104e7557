"""Startup validation of composed Hydra configs (torch-free).

Every entry point validates its config before it loads a model or a dataset, so a wrong value
fails in milliseconds with one line naming the field and what is allowed. Hydra itself rejects
unknown config group options (``circuit=foo``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpc.choices import (
    ATTENTION_IMPLS,
    CIRCUIT_KINDS,
    CODEC_NAMES,
    EXTRA_POSITIONS,
    HEAD_INITS,
    LOSS_NAMES,
    MODEL_NAMES,
    STAGES,
)
from mtpc.choices import DTYPE_NAMES as DTYPES
from mtpc.choices import SAMPLING_POLICIES as REGENERATE_POLICIES
from mtpc.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is outside what MTPC accepts; the message names the field."""


_MISSING = object()


def _get(cfg: Mapping[str, Any], dotted: str) -> Any:
    if isinstance(cfg, DictConfig):  # resolves interpolations of this field only
        return OmegaConf.select(cfg, dotted, default=_MISSING)
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _check_choice(
    cfg: Mapping[str, Any], field: str, allowed: Iterable[str], optional: bool = False
) -> None:
    allowed = tuple(allowed)
    value = _get(cfg, field)
    if value is _MISSING and optional:
        return
    if value is _MISSING:
        raise ConfigError(f"{field} is missing from the config")
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; allowed: {', '.join(allowed)}")


def _check_int(
    cfg: Mapping[str, Any], field: str, minimum: int, optional: bool = False
) -> int | None:
    value = _get(cfg, field)
    if value is _MISSING or value is None:
        if optional:
            return None
        raise ConfigError(f"{field} is missing; allowed: an integer >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field}={value!r} is not allowed; allowed: an integer >= {minimum}")
    return value


def _check_float(
    cfg: Mapping[str, Any],
    field: str,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = _get(cfg, field)
    if value is _MISSING or value is None:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    below = number and (value <= low if low_open else value < low)
    above = number and (value >= high if high_open else value > high)
    if not number or below or above:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{field}={value!r} is not allowed; allowed: a number in {interval}")


def _check_model(cfg: Mapping[str, Any]) -> None:
    _check_choice(cfg, "model.name", MODEL_NAMES)
    _check_choice(cfg, "model.dtype", DTYPES)
    _check_choice(cfg, "model.codec", CODEC_NAMES)
    _check_choice(cfg, "model.attention_impl", ATTENTION_IMPLS, optional=True)  # EvaByte's
    path = _get(cfg, "model.path")
    local = _get(cfg, "model.name") == "tiny" or (isinstance(path, str) and _looks_local(path))
    if isinstance(path, str) and path and local and not Path(path).expanduser().exists():
        raise ConfigError(
            f"model.path={path!r} does not exist; allowed: an existing local checkpoint folder, "
            "a hub id (owner/name; not for model=tiny), or null for the model's default"
        )


def _looks_local(path: str) -> bool:
    """A path rather than a hub id (``owner/name`` with no leading ``.``, ``/`` or ``~``)."""
    if path.startswith((".", "/", "~")) or "\\" in path:
        return True
    return path.count("/") != 1  # a hub id is exactly owner/name


def _check_schedule(cfg: Mapping[str, Any]) -> None:
    """optimizer.lr, trainer.max_steps and the checkpoint interval (training only)."""
    lr = _get(cfg, "optimizer.lr")
    numeric = not isinstance(lr, bool) and isinstance(lr, int | float)
    if lr is not _MISSING and not (numeric and 0 < lr < float("inf")):
        raise ConfigError(f"optimizer.lr={lr!r} is not allowed; allowed: a number > 0")
    steps = _get(cfg, "trainer.max_steps")
    whole = not isinstance(steps, bool) and isinstance(steps, int) and (steps >= 1 or steps == -1)
    if steps is not _MISSING and steps is not None and not whole:
        raise ConfigError(
            f"trainer.max_steps={steps!r} is not allowed; allowed: an integer >= 1, "
            "or -1 (the whole epoch); a run of 0 steps would export an untrained draft"
        )
    _check_int(cfg, "callbacks.checkpoint_every_n_steps", 1, optional=True)
    _check_int(cfg, "callbacks.save_top_k", -1, optional=True)


def _check_circuit(cfg: Mapping[str, Any]) -> None:
    _check_choice(cfg, "circuit.kind", CIRCUIT_KINDS)
    _check_int(cfg, "circuit.window", 1)
    rank = _check_int(cfg, "circuit.rank", 1)
    if _get(cfg, "circuit.kind") == "ff" and rank != 1:
        raise ConfigError(
            f"circuit.rank={rank} is not allowed with circuit.kind=ff; allowed: 1 "
            "(use circuit=cp for a mixture of rank > 1)"
        )
    _check_float(cfg, "circuit.sum_init_std", 0.0, float("inf"), high_open=True)
    _check_float(cfg, "circuit.init_std", 0.0, float("inf"), high_open=True)
    _check_choice(cfg, "circuit.extra_positions", EXTRA_POSITIONS, optional=True)
    _check_choice(cfg, "circuit.head_init", HEAD_INITS, optional=True)
    for flag in ("circuit.identity_init", "loss.normalise_discount", "data.pack_documents"):
        if _get(cfg, flag) not in (_MISSING, True, False):
            raise ConfigError(f"{flag}={_get(cfg, flag)!r} is not allowed; allowed: true, false")


def _check_optimizer(cfg: Mapping[str, Any]) -> None:
    """AdamW's weight decay and betas (the lr is checked with the schedule)."""
    _check_float(cfg, "optimizer.weight_decay", 0.0, float("inf"), high_open=True)
    betas = _get(cfg, "optimizer.betas")
    if betas is _MISSING or betas is None:
        return
    values = list(betas) if isinstance(betas, list | tuple | ListConfig) else []
    valid = [not isinstance(b, bool) and isinstance(b, int | float) and 0 <= b < 1 for b in values]
    if len(values) != 2 or not all(valid):
        raise ConfigError(
            f"optimizer.betas={betas!r} is not allowed; allowed: two numbers in [0, 1), "
            "e.g. [0.9, 0.999]"
        )


def _check_scheduler(cfg: Mapping[str, Any]) -> None:
    """``scheduler``: null or a partial LR scheduler (a mapping with ``_target_``)."""
    scheduler = _get(cfg, "scheduler")
    if scheduler is _MISSING or scheduler is None:
        return
    if not isinstance(scheduler, Mapping) or "_target_" not in scheduler:
        raise ConfigError(
            f"scheduler={scheduler!r} is not allowed; allowed: null or a partial LR scheduler, "
            "e.g. {_target_: torch.optim.lr_scheduler.LinearLR, _partial_: true}"
        )


def _check_lora(cfg: Mapping[str, Any]) -> None:
    _check_int(cfg, "lora.layers", 0)
    _check_int(cfg, "lora.rank", 1)
    _check_float(cfg, "lora.alpha", 0.0, float("inf"), low_open=True, high_open=True)
    _check_float(cfg, "lora.dropout", 0.0, 1.0, high_open=True)


def _check_loss(cfg: Mapping[str, Any]) -> None:
    _check_choice(cfg, "loss.name", LOSS_NAMES)
    _check_float(cfg, "loss.gamma", 0.0, 1.0, low_open=True)
    _check_int(cfg, "loss.chunk_size", 1, optional=True)


def _check_stage(cfg: Mapping[str, Any]) -> None:
    _check_choice(cfg, "stage", STAGES)
    if _get(cfg, "stage") == "lora" and not _get(cfg, "init_from"):
        raise ConfigError(
            "stage=lora needs init_from=<exported draft dir or Lightning checkpoint> "
            "(the heads-only stage's result); allowed without it: stage=heads"
        )


def _check_data(cfg: Mapping[str, Any]) -> None:
    for field in ("data.seq_len", "data.batch_size", "data.max_bytes"):
        _check_int(cfg, field, 1, optional=True)
    _check_int(cfg, "data.num_workers", 0, optional=True)
    _check_float(cfg, "data.validation_fraction", 0.0, 1.0, low_open=True, high_open=True)


def validate_train_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raises :class:`ConfigError` naming the first invalid field of a training config."""
    checks = (_check_model, _check_circuit, _check_lora, _check_loss, _check_optimizer)
    for check in (*checks, _check_scheduler, _check_stage, _check_data, _check_schedule):
        check(cfg)
    _check_int(cfg, "seed", 0)
    _check_int(cfg, "global_batch_size", 1, optional=True)


def _check_eval(cfg: Mapping[str, Any]) -> None:
    _check_int(cfg, "max_new_tokens", 1)
    # prompts=spec_bench: num_prompts=null takes every question of the file
    spec_bench = _get(cfg, "prompts.name") == "spec_bench"
    _check_int(cfg, "num_prompts", 1, optional=spec_bench)
    _check_int(cfg, "num_prompt_sets", 1)
    _check_int(cfg, "seed", 0)


def validate_eval_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raises :class:`ConfigError` naming the first invalid field of an evaluation config."""
    for check in (_check_model, _check_data, _check_eval):
        check(cfg)


def _check_regenerate(cfg: Mapping[str, Any]) -> None:
    _check_int(cfg, "max_new_tokens", 1)
    _check_int(cfg, "seed", 0)
    num_shards = _check_int(cfg, "num_shards", 1)
    shard = _check_int(cfg, "shard", 0)
    if num_shards is not None and shard is not None and shard >= num_shards:
        raise ConfigError(
            f"shard={shard} is not allowed with num_shards={num_shards}; "
            f"allowed: an integer in 0..{num_shards - 1}"
        )
    if _get(cfg, "greedy") not in (True, False):
        raise ConfigError(f"greedy={_get(cfg, 'greedy')!r} is not allowed; allowed: true, false")
    _check_float(cfg, "temperature", 0.0, float("inf"), low_open=True, high_open=True)
    _check_float(cfg, "top_p", 0.0, 1.0, low_open=True)
    _check_int(cfg, "top_k", 1, optional=True)
    _check_int(cfg, "num_threads", 1, optional=True)
    _check_choice(cfg, "policy", REGENERATE_POLICIES)
    # the drafting choice as ``mtpc.generate`` checks it (torch-free), in the config's spelling
    from mtpc.decoding.settings import CONFIG, SettingsError, check_drafting

    drafting, proposal = (
        None if (v := _get(cfg, f)) is _MISSING else v for f in ("drafting", "proposal")
    )
    try:
        check_drafting(_get(cfg, "greedy") is not False, drafting, proposal, spell=CONFIG)
    except SettingsError as err:
        raise ConfigError(str(err)) from None
    draft = _get(cfg, "draft")
    if draft not in (_MISSING, None) and (
        not isinstance(draft, str) or not (Path(draft).expanduser() / "config.json").is_file()
    ):
        raise ConfigError(
            f"draft={draft!r} is not allowed; allowed: an exported draft folder "
            "(with config.json, e.g. outputs/train/<run>/draft) or null (autoregressive)"
        )
    if not isinstance(_get(cfg, "device"), str):
        raise ConfigError(f"device={_get(cfg, 'device')!r} is not allowed; allowed: cpu, cuda[:i]")


def validate_regenerate_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raises :class:`ConfigError` naming the first invalid field of a regeneration config."""
    for check in (_check_model, _check_data, _check_regenerate):
        check(cfg)
