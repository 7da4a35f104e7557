"""What an evaluation loads: the drafts, the target they were exported for (refusing another),
the prompt sets and the device."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mtpc.benchmarking import cuda_index
from mtpc.data.prompts import UnknownSourceError
from mtpc.evaluation.checks import EvalConfigError, get_field, plain

logger = logging.getLogger(__name__)


TRAIN_HINT = "train one with `python train.py` or pass draft=<exported draft dir>"


def root_dir(cfg: Any) -> Path:
    root = get_field(cfg, "paths.root_dir")
    return Path(root) if root else Path(__file__).resolve().parents[2]


def resolve_drafts(cfg: Any, key: str = "draft") -> list[Path]:
    """The drafts named by ``cfg[key]`` (a dir or a list); for ``draft``, else the last trained.

    Raises:
        DraftError: a named folder is a training run folder (the message names its
            ``draft/``).
        FileNotFoundError: no draft given and ``outputs/last_draft.txt`` is missing, or a
            draft folder does not exist; the message says how to make one.
    """
    from mtpc.errors import DraftError
    from mtpc.export import CONFIG_NAME

    draft = get_field(cfg, key)
    if draft is None and key == "draft":
        marker = root_dir(cfg) / "outputs" / "last_draft.txt"
        if not marker.is_file():
            raise FileNotFoundError(f"no draft given and {marker} does not exist: {TRAIN_HINT}")
        draft = marker.read_text(encoding="utf-8").strip()
    paths = [] if draft is None else [draft] if isinstance(draft, str | Path) else list(draft)
    out = []
    for p in paths:
        path = Path(str(p))
        if not path.is_absolute():
            path = root_dir(cfg) / path
        if not (path / CONFIG_NAME).is_file():
            if (path / "draft" / CONFIG_NAME).is_file():
                raise DraftError(
                    f"{key}={p} is a training run folder, not an exported draft; "
                    f"use {key}={Path(str(p)) / 'draft'}"
                )
            raise FileNotFoundError(
                f"{key}={p} is not an exported draft folder (no config.json); {TRAIN_HINT}"
            )
        out.append(path)
    return out


TARGET_FIELDS = ("name", "path", "revision", "dtype")
"""The target identity an exported draft records (``config.json`` ``target``): the evaluation
takes it from the draft; a ``model.*`` override may restate it, never contradict it."""


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def recorded_target(path: Path) -> dict[str, Any]:
    """The target a draft was exported for, as ``model.*`` fields (name, path, revision, dtype)."""
    from mtpc.export import read_config

    t = read_config(path)["target"]
    return {"name": t.get("model"), "path": t.get("path"), "revision": t.get("revision"),
            "dtype": t.get("dtype")}  # fmt: skip


def explicit_model_fields(overrides: Sequence[str], cfg: Any) -> dict[str, Any]:
    """The ``model.*`` fields a command line sets (``model=<group>`` sets ``name``), with the
    values ``cfg`` composed for them; every other field of ``cfg.model`` is a group default.

    Args:
        overrides: Hydra's task overrides (``HydraConfig.get().overrides.task``), e.g.
            ``["draft=d", "model=evabyte", "model.path=/ckpt"]``.
        cfg: the composed config.
    """
    fields: dict[str, Any] = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "model":
            fields["name"] = get_field(cfg, "model.name")
        elif key.startswith("model."):
            fields[key.removeprefix("model.")] = plain(get_field(cfg, key))
    return fields


def resolve_target(
    cfg: Any, drafts: Sequence[Path], explicit: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The evaluation's ``model`` config: the drafts' recorded target, its group's other
    fields (``configs/model/<name>.yaml``: codec, attention path) and the explicit overrides.

    Args:
        cfg: the evaluation config.
        drafts: the drafts and baselines to evaluate (at least one).
        explicit: the ``model.*`` fields given on the command line (:func:`explicit_model_fields`);
            ``None`` (a call from Python without Hydra): none.

    Raises:
        TargetMismatchError: an explicit identity field differs from the recorded one (the
            message names the field and both values), or two drafts record different targets.
    """
    from mtpc.backbones import BACKBONES
    from mtpc.export import TargetMismatchError

    target = recorded_target(drafts[0])
    for path in drafts[1:]:
        other = recorded_target(path)
        differ = [f for f in ("name", "path", "revision") if other[f] != target[f]]
        if differ:
            f = differ[0]
            raise TargetMismatchError(
                f"draft {path} was exported for model.{f}={other[f]!r} but draft {drafts[0]} "
                f"for model.{f}={target[f]!r}; one evaluation has one target: evaluate them "
                "in separate calls"
            )
    explicit = dict(explicit or {})
    for field in TARGET_FIELDS:
        if field in explicit and explicit[field] != target[field]:
            raise TargetMismatchError(
                f"model.{field}={explicit[field]!r} contradicts draft {drafts[0]}, exported for "
                f"model.{field}={target[field]!r}; drop the override (the target comes from "
                "the draft)"
            )
    group: dict[str, Any] = {}
    if target["name"] in BACKBONES:  # the group's other fields (codec, attention path)
        group = plain(OmegaConf.load(CONFIGS / "model" / f"{target['name']}.yaml"))
    current = plain(get_field(cfg, "model")) or {}
    if current.get("name") == target["name"]:  # model=<the same group>: its own fields
        group = {**group, **current}
    model = {**group, **{k: v for k, v in target.items() if k != "dtype" or v is not None}}
    model.update({k: v for k, v in explicit.items() if k not in TARGET_FIELDS})
    if target["name"] not in BACKBONES:
        model.setdefault("codec", read_config_codec(drafts[0]))
    return model


def read_config_codec(path: Path) -> str:
    from mtpc.export import read_config

    return str(read_config(path)["codec"])


def with_model(cfg: Any, model: Mapping[str, Any]) -> Any:
    """``cfg`` with ``model`` replaced (a DictConfig in place, a mapping copied)."""
    if isinstance(cfg, DictConfig):
        with open_dict(cfg):
            cfg.model = OmegaConf.create(dict(model))
        return cfg
    return {**cfg, "model": dict(model)}


def load_target(cfg: Any) -> Any:
    """The configured target (``model=``) as a backbone on ``device``."""
    from mtpc.backbones import load_backbone

    return load_backbone(
        str(get_field(cfg, "model.name", "tiny")),
        path=get_field(cfg, "model.path"),
        revision=get_field(cfg, "model.revision"),
        dtype=get_field(cfg, "model.dtype", "float32"),
        device=str(get_field(cfg, "device", "cpu")),
        attention_impl=str(get_field(cfg, "model.attention_impl", "auto")),
    )


def check_target_name(path: Path, cfg: Any) -> str | None:
    """The registry target a draft was exported for; refuses one other than ``model.name``.

    Raises:
        ValueError: the draft names another registry target than ``model.name``.
    """
    from mtpc.backbones import BACKBONES
    from mtpc.export import TargetMismatchError, read_config

    recorded = read_config(path)["target"].get("model")
    name = get_field(cfg, "model.name", "tiny")
    if recorded in BACKBONES and recorded != name:
        raise TargetMismatchError(
            f"draft {path} was exported for target model {recorded!r}, but model={name}; "
            f"evaluate it with model={recorded}"
        )
    return recorded


def load_for_eval(path: Path, cfg: Any) -> Any:
    """Loads a draft against the configured target (``model=``), refusing another target.

    Raises:
        ValueError: the draft names another registry target than ``model.name``.
        TargetMismatchError: the target's weights differ from the recorded fingerprint.
    """
    from mtpc.backbones import BACKBONES
    from mtpc.model import MTPCModel

    recorded = check_target_name(path, cfg)
    name = get_field(cfg, "model.name", "tiny")
    device = str(get_field(cfg, "device", "cpu"))
    if recorded == name and name in BACKBONES:
        return MTPCModel.from_pretrained(path, target=load_target(cfg))
    return MTPCModel.from_pretrained(path, device=device)  # an HF target rebuilt from its path


def spec_bench_path(cfg: Any) -> Path:
    """``prompts.path`` (relative to the project root, as ``draft=`` is)."""
    path = Path(str(get_field(cfg, "prompts.path"))).expanduser()
    return path if path.is_absolute() else root_dir(cfg) / path


def spec_bench_categories(cfg: Any) -> list[str] | None:
    """``prompts.categories`` as a list (``prompts.categories=writing`` is ``[writing]``);
    None: every category."""
    categories = plain(get_field(cfg, "prompts.categories"))
    return [categories] if isinstance(categories, str) else categories


def spec_bench_questions(cfg: Any) -> tuple[list[Any], str] | None:
    """``prompts=spec_bench``: the selected questions (``prompts.categories``,
    ``prompts.turns``) and the file's sha256; None for the data group's prompts.

    Raises:
        SpecBenchError: a bad file or an unknown category (one line naming the file, line).
    """
    if get_field(cfg, "prompts") is None:
        return None
    from mtpc.data.spec_bench import read_questions, select_questions

    path = spec_bench_path(cfg)
    questions, sha256 = read_questions(path)
    return select_questions(
        questions, path, spec_bench_categories(cfg), get_field(cfg, "prompts.turns")
    ), sha256


def load_prompt_sets(cfg: Any, codec: str, max_prompt_length: int | None) -> list[list[Any]]:
    """Evaluation prompt sets from the data pipeline's validation split (``sources``: only
    those), or with ``prompts=spec_bench`` from the Spec-Bench file (runs over its questions)."""
    from hydra.utils import instantiate

    spec = spec_bench_questions(cfg)
    if spec is not None:
        from mtpc.backbones.codecs import get_codec
        from mtpc.data.spec_bench import build_prompt_sets

        num_prompts = get_field(cfg, "num_prompts")
        return list(
            build_prompt_sets(
                spec[0], get_codec(codec), num_sets=int(get_field(cfg, "num_prompt_sets", 1)),
                max_new_tokens=int(get_field(cfg, "max_new_tokens", 128)),
                max_prompt_length=max_prompt_length,
                per_category=get_field(cfg, "prompts.per_category"),
                num_prompts=None if num_prompts is None else int(num_prompts),
                path=spec_bench_path(cfg),
            )
        )  # fmt: skip

    data = get_field(cfg, "data")
    module = instantiate(data, codec=codec) if data is not None else None
    if module is None:
        from mtpc.data.datamodule import build_datamodule

        module = build_datamodule(codec=codec)
    seed = int(get_field(cfg, "seed", 0))
    sets = int(get_field(cfg, "num_prompt_sets", 1))
    sources = plain(get_field(cfg, "sources"))
    return module.prompt_sets(
        num_prompts=int(get_field(cfg, "num_prompts", 8)),
        seeds=tuple(range(seed, seed + sets)),
        english_only=bool(get_field(cfg, "english_only", True)),
        max_prompt_length=max_prompt_length,
        **({"sources": [sources] if isinstance(sources, str) else sources} if sources else {}),
    )


def use_device(device: str) -> None:
    """Makes ``device`` (``cuda:<i>``) the current CUDA device, so that kernels launched
    without an explicit device (triton's, EvaByte's) and the memory counters use it."""
    index = cuda_index(device)
    if index is not None:
        torch.cuda.set_device(index)


def load_prompts(cfg: Any, codec: str, limit: int | None) -> list[list[Any]]:
    try:
        return load_prompt_sets(cfg, codec, limit)
    except UnknownSourceError as e:
        raise EvalConfigError(str(e)) from None


def hydra_model_overrides(cfg: Any) -> dict[str, Any] | None:
    """The ``model.*`` fields of this Hydra run's command line; ``None`` outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return explicit_model_fields(list(HydraConfig.get().overrides.task), cfg)
