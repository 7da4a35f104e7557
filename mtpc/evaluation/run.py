"""``evaluate(cfg)``: throughput of exported drafts against autoregressive decoding.

Called by ``python eval.py`` (Hydra) and by ``scripts/sweep_eval.py``; returns the metrics.
For every draft: load it against the configured target (a draft exported for another
target is refused before any decoding), decode every prompt of every prompt set with
self-speculative decoding (and, with ``max_throughput``, once more accepting every draft),
after ``warmup`` untimed runs. Autoregressive decoding of the same target runs on the same
prompts in the same call; the speed-up is the ratio of throughputs per prompt set. Metrics
are defined in ``mtpc.evaluation.metrics``.

Each decoded prompt is appended to the evaluation folder's ``records.jsonl`` as it finishes
(``mtpc.evaluation.records``); the tables are then built from those records
(``mtpc.evaluation.report``). Re-running the same command finds the same folder and decodes
only the prompts not recorded yet; ``report=<folder>`` (or several) rebuilds the tables
without decoding. A progress bar per draft and pass (tqdm, on a terminal only, off with
``progress=false``) and one log line per finished draft say how far a run is.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import resource
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from mtpc.data.prompts import UnknownSourceError
from mtpc.decoding import (
    DRAFT_MODES,
    POLICIES,
    SAMPLING_DRAFT_MODES,
    default_draft_mode,
    generate,
)
from mtpc.errors import UserError
from mtpc.evaluation.metrics import prompt_record
from mtpc.evaluation.records import (
    MANIFEST,
    RecordsError,
    RecordStore,
    expand_folders,
    hetero_draft_path,
)
from mtpc.evaluation.report import build_report, report_folders

logger = logging.getLogger(__name__)

TRAIN_HINT = "train one with `python train.py` or pass draft=<exported draft dir>"


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
    choice("draft_mode", DRAFT_MODES, optional=True)
    if _get(cfg, "greedy") is False and _get(cfg, "draft_mode") not in (
        None,
        *SAMPLING_DRAFT_MODES,
    ):
        raise EvalConfigError(
            f"draft_mode={_get(cfg, 'draft_mode')!r} is not allowed with greedy=false; allowed: "
            f"{', '.join(SAMPLING_DRAFT_MODES)} or null (speculative sampling is exact only for "
            "drafts drawn from the circuit)"
        )
    for field in ("greedy", "suppress_eos", "max_throughput", "english_only", "plots", "progress",
                  "warmup_window"):  # fmt: skip
        choice(field, (True, False), optional=field in ("progress", "warmup_window"))
    choice("resume", RESUME, optional=True)
    budgets = _plain(_get(cfg, "tree_budget"))
    for b in budgets if isinstance(budgets, list) else [budgets]:
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise EvalConfigError(
                f"tree_budget={budgets!r} is not allowed; allowed: null, an integer >= 0 or a "
                "list of them, e.g. tree_budget=[16,32,64]"
            )
    floor = _get(cfg, "tree_floor", 0.0)
    if floor is not None and (
        isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor < 1
    ):
        raise EvalConfigError(f"tree_floor={floor!r} is not allowed; allowed: a number in [0, 1)")
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


def _root(cfg: Any) -> Path:
    root = _get(cfg, "paths.root_dir")
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

    draft = _get(cfg, key)
    if draft is None and key == "draft":
        marker = _root(cfg) / "outputs" / "last_draft.txt"
        if not marker.is_file():
            raise FileNotFoundError(f"no draft given and {marker} does not exist: {TRAIN_HINT}")
        draft = marker.read_text(encoding="utf-8").strip()
    paths = [] if draft is None else [draft] if isinstance(draft, str | Path) else list(draft)
    out = []
    for p in paths:
        path = Path(str(p))
        if not path.is_absolute():
            path = _root(cfg) / path
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
            fields["name"] = _get(cfg, "model.name")
        elif key.startswith("model."):
            fields[key.removeprefix("model.")] = _plain(_get(cfg, key))
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
        group = _plain(OmegaConf.load(CONFIGS / "model" / f"{target['name']}.yaml"))
    current = _plain(_get(cfg, "model")) or {}
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
        str(_get(cfg, "model.name", "tiny")),
        path=_get(cfg, "model.path"),
        revision=_get(cfg, "model.revision"),
        dtype=_get(cfg, "model.dtype", "float32"),
        device=str(_get(cfg, "device", "cpu")),
        attention_impl=str(_get(cfg, "model.attention_impl", "auto")),
    )


def check_target_name(path: Path, cfg: Any) -> str | None:
    """The registry target a draft was exported for; refuses one other than ``model.name``.

    Raises:
        ValueError: the draft names another registry target than ``model.name``.
    """
    from mtpc.backbones import BACKBONES
    from mtpc.export import TargetMismatchError, read_config

    recorded = read_config(path)["target"].get("model")
    name = _get(cfg, "model.name", "tiny")
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
    name = _get(cfg, "model.name", "tiny")
    device = str(_get(cfg, "device", "cpu"))
    if recorded == name and name in BACKBONES:
        return MTPCModel.from_pretrained(path, target=load_target(cfg))
    return MTPCModel.from_pretrained(path, device=device)  # an HF target rebuilt from its path


def load_prompt_sets(cfg: Any, codec: str, max_prompt_length: int | None) -> list[list[Any]]:
    """Evaluation prompt sets from the data pipeline's validation split (``sources``: only those)."""
    from hydra.utils import instantiate

    data = _get(cfg, "data")
    module = instantiate(data, codec=codec) if data is not None else None
    if module is None:
        from mtpc.data.datamodule import build_datamodule

        module = build_datamodule(codec=codec)
    seed = int(_get(cfg, "seed", 0))
    sets = int(_get(cfg, "num_prompt_sets", 1))
    sources = _plain(_get(cfg, "sources"))
    return module.prompt_sets(
        num_prompts=int(_get(cfg, "num_prompts", 8)),
        seeds=tuple(range(seed, seed + sets)),
        english_only=bool(_get(cfg, "english_only", True)),
        max_prompt_length=max_prompt_length,
        **({"sources": [sources] if isinstance(sources, str) else sources} if sources else {}),
    )


def cuda_index(device: str) -> int | None:
    """The CUDA device index of ``device`` (``cuda`` -> the current one); None for the CPU."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else int(index)


def use_device(device: str) -> None:
    """Makes ``device`` (``cuda:<i>``) the current CUDA device, so that kernels launched
    without an explicit device (triton's, EvaByte's) and the memory counters use it."""
    index = cuda_index(device)
    if index is not None:
        torch.cuda.set_device(index)


def _sync_memory_reset(device: str) -> None:
    index = cuda_index(device)
    if index is not None:
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)


def _peak_memory_mb(device: str) -> float:
    index = cuda_index(device)
    if index is not None:
        return torch.cuda.max_memory_allocated(index) / 2**20
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def decode_kwargs(cfg: Any) -> dict[str, Any]:
    """The ``mtpc.generate`` keywords the evaluation settings give."""
    return {
        "max_new_tokens": int(_get(cfg, "max_new_tokens", 128)),
        "greedy": bool(_get(cfg, "greedy", True)),
        "policy": _get(cfg, "policy", "condition"),
        "draft_mode": _get(cfg, "draft_mode"),
        "temperature": float(_get(cfg, "temperature", 1.0)),
        "top_k": _get(cfg, "top_k"),
        "top_p": _get(cfg, "top_p"),
        "suppress_eos": bool(_get(cfg, "suppress_eos", True)),
        "tree_floor": float(_get(cfg, "tree_floor", 0.0) or 0.0),
    }


PASSES: dict[str, dict[str, Any]] = {
    "ar": {"method": "autoregressive"},
    "speculative": {},
    "max_throughput": {"max_throughput": True},
}
"""The decoding passes of an evaluation and their ``mtpc.generate`` overrides; ``tree<B>``
(from ``tree_budget``) decodes with a token tree of B nodes."""


def pass_overrides(pass_name: str) -> dict[str, Any]:
    """The ``mtpc.generate`` overrides of a pass (``ar``, ``speculative``, ``tree<B>``, ...)."""
    if pass_name.startswith("tree"):
        return {"tree_budget": int(pass_name.removeprefix("tree"))}
    return PASSES[pass_name]


def tree_budgets(cfg: Any) -> list[int]:
    """The positive budgets of ``tree_budget`` (null, an int or a list), sorted, no repeats."""
    value = _plain(_get(cfg, "tree_budget"))
    values = [] if value is None else value if isinstance(value, list) else [value]
    return sorted({int(v) for v in values if v})


SETTINGS = (
    "greedy", "policy", "draft_mode", "temperature", "top_k", "top_p", "num_prompts",
    "num_prompt_sets", "max_new_tokens", "warmup", "warmup_window", "suppress_eos",
    "max_throughput",
    "device", "english_only", "seed", "num_threads", "max_prompt_length", "sources",
    "tree_budget", "tree_floor",
)  # fmt: skip
"""Settings that define a measurement (their change starts another evaluation folder)."""

DATA_IGNORED = ("cache_dir", "num_workers", "batch_size", "streaming", "pack_documents")
"""Data fields that do not change the prompts."""


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _draft_name(path: Path) -> str:
    return path.name if path.name != "draft" else path.parent.name


def build_manifest(cfg: Any, drafts: Sequence[Path], baselines: Sequence[Path]) -> dict[str, Any]:
    """What an evaluation measures (settings, target, data, drafts, device) and its provenance."""
    from mtpc.evaluation.records import FORMAT_VERSION, device_name, draft_fingerprint, provenance
    from mtpc.export import read_config

    entries = []
    greedy = bool(_get(cfg, "greedy", True))
    for i, path in enumerate([*drafts, *baselines]):
        check_target_name(path, cfg)
        config = read_config(path)
        c = config["circuit"]
        # the mode each draft decodes with: a change of the per-family default is another
        # measurement (another folder), never resumed into the old records
        mode = _get(cfg, "draft_mode") or default_draft_mode(c["kind"], greedy)
        entries.append(
            {"path": str(path), "name": _draft_name(path), "kind": c["kind"],
             "window": c["window"], "rank": c["rank"], "lora_layers": config["lora"]["layers"],
             "baseline": i >= len(drafts), "fingerprint": draft_fingerprint(path),
             "draft_mode": mode}
        )  # fmt: skip
    data = _plain(_get(cfg, "data")) or {}
    device = str(_get(cfg, "device", "cpu"))
    settings = {k: _plain(_get(cfg, k)) for k in SETTINGS}
    if _get(cfg, "drafter") is not None:  # drafter=hetero: another drafter, another folder
        settings["drafter"] = _plain(_get(cfg, "drafter"))
    if isinstance(settings["sources"], str):  # sources=a is sources=[a]
        settings["sources"] = [settings["sources"]]
    return {
        "format": FORMAT_VERSION,
        "settings": settings,
        "target": _plain(_get(cfg, "model")),
        "data": {k: v for k, v in data.items() if k not in DATA_IGNORED},
        "drafts": entries,
        "device_name": device_name(device),
        "sessions": [provenance(device, _root(cfg))],
    }


def eval_folder(cfg: Any, manifest: Mapping[str, Any]) -> Path:
    """``output_dir`` when given, else ``outputs/eval/<name from the drafts and settings>``."""
    from mtpc.evaluation.records import folder_name

    try:
        out = _get(cfg, "output_dir")
    except Exception:  # an interpolation such as ${hydra:...} outside a Hydra run
        out = None
    return Path(out) if out else _root(cfg) / "outputs" / "eval" / folder_name(manifest)


class _Progress:
    """A tqdm bar over the prompts of one pass (stderr, terminals only), or nothing."""

    def __init__(self, enabled: bool, total: int, done: int, desc: str) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total, initial=done, desc=desc, unit="prompt", leave=False,
            dynamic_ncols=True, disable=None if enabled else True,
        )  # fmt: skip

    def step(self, note: str) -> None:
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


def warmup_prompts(model: Any, prompt_sets: Sequence[Sequence[Any]], cfg: Any) -> list[list[int]]:
    """The prompts each pass decodes untimed (``warmup`` times) before it is timed, with its
    own decoding method.

    The first prompt; with ``warmup_window`` on a target with an attention window (EvaByte's
    ``window_size`` W), also one of ``2W - h`` ids (the prompts' longest, repeated), h =
    max(1, min(max_new_tokens, W) // 2): its prefill compresses a full window and its
    decoding reaches the next window boundary within h new ids, so the first window
    compression and the kernels' shapes of a longer prefill (triton specialises per length)
    are compiled before the timed prompts. Left out when it would not fit the context.
    """
    prompts = [list(prompt_sets[0][0].prompt_ids)]
    window = getattr(model.backbone, "window_size", None)
    if not _get(cfg, "warmup_window", True) or not window:
        return prompts
    new = int(_get(cfg, "max_new_tokens", 128))
    length = 2 * int(window) - max(1, min(new, int(window)) // 2)
    context = getattr(model.backbone.config, "max_position_embeddings", None)
    if context and length + new + model.head.window > int(context):
        logger.info("warm-up: a prompt of %d ids does not fit the context %s", length, context)
        return prompts
    longest = max((list(p.prompt_ids) for s in prompt_sets for p in s), key=len)
    ids = longest * (length // len(longest) + 1)
    return [*prompts, ids[:length]]


def run_pass(
    store: RecordStore,
    model: Any,
    prompt_sets: Sequence[Sequence[Any]],
    cfg: Any,
    draft: Mapping[str, Any] | None,
    pass_name: str,
) -> int:
    """Decodes the prompts of one pass that ``store`` has no record of; returns their number.

    ``warmup`` untimed runs on each of :func:`warmup_prompts` come first; each prompt's record is appended
    (and flushed) as soon as it is decoded; a ``pass`` record with the peak memory closes
    the pass.

    Args:
        store: the evaluation folder.
        model: the loaded draft (its backbone is the target for the ``ar`` pass).
        prompt_sets: the prompt sets.
        cfg: the evaluation settings.
        draft: the draft's manifest entry; None for the ``ar`` pass.
        pass_name: a key of :data:`PASSES`.
    """
    path = None if draft is None else draft["path"]
    name = "AR (target)" if draft is None else draft["name"]
    todo = store.pending(prompt_sets, path, pass_name)
    if not todo:  # killed between the last prompt and the pass record
        store.append(
            {"type": "pass", "draft_path": path, "pass": pass_name, "peak_memory_mb": None}
        )
        return 0
    kwargs = {**decode_kwargs(cfg), **pass_overrides(pass_name)}
    seed = int(_get(cfg, "seed", 0))
    device = str(_get(cfg, "device", "cpu"))
    reference = {
        (r["set"], r["index"]): r["tokens_sha1"]
        for r in store.records
        if r.get("type") == "prompt" and r["pass"] == "ar"
    }
    drafting = pass_name == "speculative" or pass_name.startswith("tree")
    check = drafting and kwargs["greedy"]
    _sync_memory_reset(device)
    for w in range(int(_get(cfg, "warmup", 1))):
        for ids in warmup_prompts(model, prompt_sets, cfg):
            generate(model, ids, seed=seed + w, **kwargs)
    total = sum(len(p) for p in prompt_sets)
    bar = _Progress(
        bool(_get(cfg, "progress", True)), total, total - len(todo), f"{name} [{pass_name}]"
    )
    try:
        for k, i, p in todo:
            res = generate(model, p.prompt_ids, seed=seed + i, **kwargs)
            sha = hashlib.sha1(json.dumps(res.tokens).encode()).hexdigest()
            store.append(
                {"type": "prompt", "draft": name, "draft_path": path, "pass": pass_name,
                 "set": k, "index": i, "prompt_id": p.id, "source": p.source, "seed": seed + i,
                 "tokens_sha1": sha,
                 "equal_reference": reference.get((k, i)) == sha if check else None,
                 **({"draft_mode": res.draft_mode} if drafting else {}),
                 **prompt_record(res, per_cycle=drafting)}
            )  # fmt: skip
            bar.step(f"set {k + 1}/{len(prompt_sets)}")
    finally:
        bar.close()
    store.append(
        {"type": "pass", "draft_path": path, "pass": pass_name,
         "peak_memory_mb": _peak_memory_mb(device)}
    )  # fmt: skip
    return len(todo)


def _check_prompts(store: RecordStore, prompt_sets: Sequence[Sequence[Any]]) -> None:
    """Refuses records whose (set, index) is another prompt than today's (the data changed)."""
    for r in store.records:
        if r.get("type") != "prompt":
            continue
        k, i = r["set"], r["index"]
        here = prompt_sets[k][i].id if k < len(prompt_sets) and i < len(prompt_sets[k]) else None
        if here != r["prompt_id"]:
            raise RecordsError(
                f"{store.folder}: set {k} prompt {i} was {r['prompt_id']!r} and is now {here!r}: "
                "the prompts changed; use another output_dir (or resume=force after removing "
                "records.jsonl)"
            )


def _load_prompts(cfg: Any, codec: str, limit: int | None) -> list[list[Any]]:
    try:
        return load_prompt_sets(cfg, codec, limit)
    except UnknownSourceError as e:
        raise EvalConfigError(str(e)) from None


def decode_all(
    cfg: Any, store: RecordStore, drafts: Sequence[Path], baselines: Sequence[Path]
) -> list[list[Any]] | None:
    """Decodes what ``store`` lacks: AR (with the first draft's target), then every draft.

    Returns:
        The prompt sets when a model was loaded (None when every record was there).
    """
    entries = store.manifest["drafts"]
    codec = str(_get(cfg, "model.codec", "tiny"))
    if entries:
        from mtpc.export import read_config

        codec = read_config(Path(entries[0]["path"]))["codec"]
    windows = [d["window"] for d in entries] or [0]
    new = int(_get(cfg, "max_new_tokens", 128))
    passes = ["speculative"] + (["max_throughput"] if _get(cfg, "max_throughput", True) else [])
    passes += [f"tree{b}" for b in tree_budgets(cfg)]
    prompt_sets: list[list[Any]] | None = None
    for index, (path, draft) in enumerate(zip([*drafts, *baselines], entries, strict=True)):
        wanted = (["ar"] if index == 0 else []) + passes

        def missing(pass_name: str, draft: Mapping[str, Any] = draft) -> bool:
            key = None if pass_name == "ar" else draft["path"]
            return not any(
                r.get("type") == "pass" and r["pass"] == pass_name and r["draft_path"] == key
                for r in store.records
            )

        todo = [p for p in wanted if missing(p)]
        if not todo:
            logger.info(
                "[%d/%d] %s: already recorded in %s (resume=never measures it again in a new "
                "folder)", index + 1, len(entries), draft["name"], store.folder,
            )  # fmt: skip
            continue
        start = time.perf_counter()
        model = load_for_eval(path, cfg)
        if prompt_sets is None:  # the target's context bounds the prompts
            context = getattr(model.backbone.config, "max_position_embeddings", None)
            limit = _get(cfg, "max_prompt_length")
            if context:
                fit = int(context) - new - max(windows)
                limit = fit if limit is None else min(int(limit), fit)
            prompt_sets = _load_prompts(cfg, codec, limit)
            _check_prompts(store, prompt_sets)
        decoded = sum(
            run_pass(store, model, prompt_sets, cfg, None if p == "ar" else draft, p) for p in todo
        )
        mine = [r for r in store.records if r.get("draft_path") in (None, draft["path"])]
        rows, _ = build_report({**store.manifest, "drafts": [draft]}, mine)
        row = next(r for r in rows if r["name"] == draft["name"])  # the chain, not a tree row
        logger.info(
            "[%d/%d] %s: %.2f tokens/cycle, %.2fx AR (%d prompts decoded in %.1f s)",
            index + 1, len(entries), draft["name"], row.get("mu_acc", math.nan),
            row.get("speedup_ar", math.nan), decoded, time.perf_counter() - start,
        )  # fmt: skip
        del model
        gc.collect()
    return prompt_sets


def evaluate(
    cfg: DictConfig | Mapping[str, Any], explicit_model: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluates the configured drafts (resuming their folder); prints the tables, writes results.

    The target is the one the drafts were exported for (their ``config.json`` ``target``;
    :func:`resolve_target`): ``python eval.py draft=<EvaByte draft>`` needs no ``model=``.
    ``model.*`` fields given on the command line (``explicit_model``; under Hydra read from
    its task overrides) may restate the recorded target or set what it does not record
    (``model.attention_impl``); one that contradicts it is refused before loading anything.

    With ``report=<folder>`` (or a list, globs allowed) nothing is decoded: the tables,
    results.json, CSVs and plots are rebuilt from the folders' records, merged.

    Returns:
        ``mtpc.evaluation.report.report_folders``'s result plus ``folder``: ``rows`` is
        [AR row, draft rows..., baseline row]; each row has mu_lat, mu_acc, mu_acc_drafts,
        tok_s, max_tok_s, speedup_ar, speedup_baseline (mean and ``*_std`` over prompt
        sets), peak memory and the acceptance per window position; ``by_source`` the
        per-source rows; ``settings``, ``provenance``, ``table``, ``files``.

    Raises:
        EvalConfigError: a setting outside what the evaluator accepts.
        RecordsError: the folder holds another evaluation's records, another evaluation
            writes to it, or the report folders cannot be merged.
    """
    from mtpc.config import validate_eval_config

    validate_eval_config(cfg)
    check_eval_fields(cfg)
    plots = bool(_get(cfg, "plots", True))
    report = _plain(_get(cfg, "report"))
    if report:
        folders = expand_folders([report] if isinstance(report, str) else report, _root(cfg))
        try:
            out = _get(cfg, "output_dir")
        except Exception:
            out = None
        if out is None and len(folders) > 1:
            raise EvalConfigError(
                "report= with several folders needs output_dir=<where the merged report goes>"
            )
        result = report_folders(folders, Path(out) if out else folders[0], plots=plots)
        print(f"results: {result['files']['json']}")
        return result

    drafter = _get(cfg, "drafter")
    # drafter=hetero alone evaluates only the other-vocabulary drafter; with draft= both
    drafts = resolve_drafts(cfg) if drafter is None or _get(cfg, "draft") else []
    base_paths = resolve_drafts(cfg, key="baseline")
    baseline_set = {b.resolve() for b in base_paths}
    drafts = [d for d in drafts if d.resolve() not in baseline_set]  # also the baseline: once
    if drafts or base_paths:  # the target comes from the drafts
        if explicit_model is None:
            explicit_model = hydra_model_overrides(cfg)
        cfg = with_model(cfg, resolve_target(cfg, [*drafts, *base_paths], explicit_model))
    threads = _get(cfg, "num_threads")
    if threads:
        torch.set_num_threads(int(threads))
    use_device(str(_get(cfg, "device", "cpu")))  # device=cuda:1: kernels and counters on GPU 1
    manifest = build_manifest(cfg, drafts, base_paths)
    folder = eval_folder(cfg, manifest)
    if _get(cfg, "resume", "auto") == "never":
        folder = fresh_folder(folder)
    logger.info("evaluation folder: %s", folder)
    new = not (folder / MANIFEST).is_file()
    with RecordStore.open(folder, manifest, force=_get(cfg, "resume", "auto") == "force") as store:
        try:
            prompt_sets = decode_all(cfg, store, drafts, base_paths)
            if drafter is not None:
                if prompt_sets is None:
                    prompt_sets = _load_prompts(
                        cfg, str(_get(cfg, "model.codec", "tiny")), _get(cfg, "max_prompt_length")
                    )
                    _check_prompts(store, prompt_sets)
                decode_hetero(cfg, store, prompt_sets)
        except Exception:
            if new and not store.records:  # refused before any decoding: leave no folder
                shutil.rmtree(folder, ignore_errors=True)
            raise
    result = report_folders([folder], folder, plots=plots)
    print(f"results: {result['files']['json']}")
    return {**result, "folder": str(folder)}


def hydra_model_overrides(cfg: Any) -> dict[str, Any] | None:
    """The ``model.*`` fields of this Hydra run's command line; ``None`` outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return explicit_model_fields(list(HydraConfig.get().overrides.task), cfg)


def fresh_folder(folder: Path) -> Path:
    """``folder`` if it holds no evaluation yet, else the first free ``<folder>-<k>``, k >= 2."""
    candidate, k = folder, 2
    while (candidate / MANIFEST).exists() or (candidate.exists() and any(candidate.iterdir())):
        candidate, k = folder.with_name(f"{folder.name}-{k}"), k + 1
    return candidate


def decode_hetero(cfg: Any, store: RecordStore, prompt_sets: list[list[Any]]) -> None:
    """Decodes the prompts of ``drafter=hetero``: the configured target drafted by another
    vocabulary.

    Each prompt is decoded by the target alone and with :func:`mtpc.generate_hetero`
    (``mtpc.evaluation.hetero.hetero_decoders``, so ``x AR`` compares like with like) and
    recorded in ``store`` as it finishes (passes ``HETERO_PASSES``, ``draft_path``
    ``drafter:<model>``); prompts already recorded are not decoded again, so a killed
    evaluation resumes. The vocabulary overlap (Timor et al., Tables 5-6) is recorded once
    (an ``overlap`` line). The rows are built from the records
    (``mtpc.evaluation.report.hetero_report``), so ``report=`` rebuilds them too.
    """
    from mtpc.backbones.codecs import get_codec
    from mtpc.evaluation.hetero import hetero_decoders, hetero_record, load_drafter, overlap_stats
    from mtpc.evaluation.report import HETERO_PASSES, hetero_row_name

    device = str(_get(cfg, "device", "cpu"))
    backbone = load_target(cfg)
    codec = get_codec(str(_get(cfg, "model.codec", "tiny")))
    drafter_model = str(_get(cfg, "drafter.model"))
    model, tokenizer = load_drafter(drafter_model, _get(cfg, "drafter.tokenizer"), device=device)
    options = {key: _get(cfg, f"drafter.{key}") for key in ("look_behind", "max_psi_paths", "psi")}
    if not _get(cfg, "greedy", True):
        options.update({k: _get(cfg, k) for k in ("temperature", "top_k", "top_p")})
    algorithm = str(_get(cfg, "drafter.algorithm", "slem"))
    lookahead = int(_get(cfg, "drafter.lookahead", 5))
    run_ar, run_sd = hetero_decoders(
        backbone.hf_model, codec, model, tokenizer, algorithm=algorithm, lookahead=lookahead,
        greedy=bool(_get(cfg, "greedy", True)), max_new_tokens=int(_get(cfg, "max_new_tokens", 128)),
        **{k: v for k, v in options.items() if v is not None},
    )  # fmt: skip
    decoders = dict(zip(HETERO_PASSES, (run_ar, run_sd), strict=True))
    key = hetero_draft_path({"model": drafter_model})
    name, seed = hetero_row_name(algorithm), int(_get(cfg, "seed", 0))
    for pass_name, decode in decoders.items():
        todo = store.pending(prompt_sets, key, pass_name)
        for w in range(int(_get(cfg, "warmup", 1)) if todo else 0):
            decode(list(prompt_sets[0][0].prompt_ids), seed + w)
        for k, i, p in todo:  # set k, prompt i: seed + k + i, as evaluate_hetero per set
            result = decode(list(p.prompt_ids), seed + k + i)
            store.append(
                {"type": "prompt", "draft": "AR (target)" if pass_name == "hetero_ar" else name,
                 "draft_path": key, "pass": pass_name, "set": k, "index": i, "prompt_id": p.id,
                 "source": p.source, "seed": seed + k + i, **hetero_record(result)}
            )  # fmt: skip
    if not any(r.get("type") == "overlap" and r["draft_path"] == key for r in store.records):
        stats = overlap_stats(codec, tokenizer, [p.prompt_ids for p in prompt_sets[0]])
        store.append({"type": "overlap", "draft_path": key, **stats})
