"""What an evaluation loads: the drafts, the target they were exported for (refusing another),
the prompt sets and the device."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mtpc.config import plain
from mtpc.data.prompts import UnknownSourceError
from mtpc.errors import DraftError
from mtpc.evaluation.settings import EvalConfigError, EvalSettings, ModelSettings, name_list
from mtpc.export import CONFIG_NAME, TargetMismatchError, read_config
from mtpc.last_draft import TRAIN_HINT, last_draft


def resolve_drafts(draft: Any, root: Path, key: str = "draft") -> list[Path]:
    """The drafts named by ``draft`` (a dir or a list; the setting ``key``, relative to the
    project ``root``); for ``draft``, None: the last trained (:func:`mtpc.last_draft.last_draft`:
    LastDraftOverlapError, FileNotFoundError). DraftError: a training run folder (the message
    names its ``draft/``); FileNotFoundError: no such draft folder."""
    if draft is None and key == "draft":
        draft = last_draft(root)
    paths = [] if draft is None else [draft] if isinstance(draft, str | Path) else list(draft)
    out = []
    for p in paths:
        path = root / str(p)  # an absolute path stays as it is
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
"""The target identity an exported draft records: a ``model.*`` override may restate it, never
contradict it."""

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def recorded_target(path: Path) -> dict[str, Any]:
    """The target a draft was exported for, as ``model.*`` fields (name, path, revision, dtype)."""
    t = read_config(path)["target"]
    return {"name": t.get("model"), **{field: t.get(field) for field in TARGET_FIELDS[1:]}}


def resolve_target(
    current: ModelSettings, drafts: Sequence[Path], explicit: Mapping[str, Any] | None
) -> ModelSettings:
    """The evaluation's target: the drafts' recorded target, its group's other fields
    (``configs/model/<name>.yaml``: codec, attention path; ``current``'s when it is the same
    group) and the ``explicit`` overrides (the ``model.*`` fields given; None: none).
    TargetMismatchError: an explicit identity field contradicts it, or two drafts differ."""
    from mtpc.backbones import BACKBONES

    target = recorded_target(drafts[0])
    for path in drafts[1:]:
        other = recorded_target(path)
        for f in ("name", "path", "revision"):
            if other[f] != target[f]:
                raise TargetMismatchError(
                    f"draft {path} was exported for model.{f}={other[f]!r} but draft "
                    f"{drafts[0]} for model.{f}={target[f]!r}; one evaluation has one target: "
                    "evaluate them in separate calls"
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
    if current.fields.get("name") == target["name"]:  # model=<the same group>: its own fields
        group = {**group, **current.fields}
    model = {**group, **{k: v for k, v in target.items() if k != "dtype" or v is not None}}
    model.update({k: v for k, v in explicit.items() if k not in TARGET_FIELDS})
    if target["name"] not in BACKBONES:
        model.setdefault("codec", str(read_config(drafts[0])["codec"]))
    return ModelSettings.from_fields(model)


def load_target(model: ModelSettings, device: str) -> Any:
    """The configured target (``model=``) as a backbone on ``device``."""
    from mtpc.backbones import load_backbone

    return load_backbone(
        str(model.name), path=model.path, revision=model.revision, dtype=model.dtype,
        device=str(device), attention_impl=str(model.attention_impl),
    )  # fmt: skip


def check_target_name(path: Path, name: str) -> str | None:
    """The registry target a draft was exported for; refuses one other than ``name``
    (``model.name``) with a ``TargetMismatchError``."""
    from mtpc.backbones import BACKBONES

    recorded = read_config(path)["target"].get("model")
    if recorded in BACKBONES and recorded != name:
        raise TargetMismatchError(
            f"draft {path} was exported for target model {recorded!r}, but model={name}; "
            f"evaluate it with model={recorded}"
        )
    return recorded


def load_for_eval(path: Path, model: ModelSettings, device: str) -> Any:
    """Loads a draft against the configured target (``model=``); TargetMismatchError for
    another registry target, or weights other than the recorded ones."""
    from mtpc.backbones import BACKBONES
    from mtpc.model import MTPCModel

    if check_target_name(path, model.name) in BACKBONES:  # then it is model.name
        return MTPCModel.from_pretrained(path, target=load_target(model, device))
    return MTPCModel.from_pretrained(path, device=device)  # an HF target rebuilt from its path


def spec_bench_path(given: str, root: Path) -> Path:
    """``prompts.path`` (``given``), relative to the project ``root`` as ``draft=`` is."""
    return root / Path(given).expanduser()  # an absolute path stays as it is


def spec_bench_questions(s: EvalSettings) -> tuple[list[Any], str] | None:
    """``prompts=spec_bench``: the selected questions and the file's sha256; None for the
    data group's prompts. SpecBenchError: a bad file or an unknown category (one line)."""
    spec = s.prompts.spec_bench
    if spec is None:
        return None
    from mtpc.data.spec_bench import read_questions, select_questions

    path = spec_bench_path(spec.path, s.output.root_dir)
    questions, sha256 = read_questions(path)
    return select_questions(questions, path, name_list(spec.categories), spec.turns), sha256


def load_prompts(s: EvalSettings, codec: str, max_prompt_length: int | None) -> list[list[Any]]:
    """Evaluation prompt sets from the data pipeline's validation split (``sources``: only
    those; EvalConfigError, listing the available ones, for one no prompt has), or with
    ``prompts=spec_bench`` from the Spec-Bench file (runs over its questions)."""
    from hydra.utils import instantiate

    p = s.prompts
    spec = spec_bench_questions(s)
    if spec is not None and p.spec_bench is not None:
        from mtpc.backbones.codecs import get_codec
        from mtpc.data.spec_bench import build_prompt_sets

        return list(
            build_prompt_sets(
                spec[0], get_codec(codec), num_sets=int(p.num_prompt_sets),
                max_new_tokens=int(s.decoding.max_new_tokens),
                max_prompt_length=max_prompt_length,
                per_category=p.spec_bench.per_category,
                num_prompts=None if p.num_prompts is None else int(p.num_prompts),
                path=spec_bench_path(p.spec_bench.path, s.output.root_dir),
            )
        )  # fmt: skip
    module = instantiate(s.data, codec=codec) if s.data is not None else None
    if module is None:
        from mtpc.data.datamodule import build_datamodule

        module = build_datamodule(codec=codec)
    seed, sets = int(s.decoding.seed), int(p.num_prompt_sets)
    sources = name_list(p.sources)
    try:
        return module.prompt_sets(
            num_prompts=int(p.num_prompts or 0),
            seeds=tuple(range(seed, seed + sets)),
            english_only=bool(p.english_only),
            max_prompt_length=max_prompt_length,
            **({"sources": sources} if sources else {}),
        )
    except UnknownSourceError as e:
        raise EvalConfigError(str(e)) from None
