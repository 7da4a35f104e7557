"""``evaluate(cfg)``: throughput of exported drafts against autoregressive decoding.

Called by ``python eval.py`` (Hydra) and by ``scripts/sweep_eval.py``; returns the metrics.
For every draft: load it against the configured target (a draft exported for another
target is refused before any decoding), decode every prompt of every prompt set with
self-speculative decoding (and, with ``max_throughput``, once more accepting every draft),
after ``warmup`` untimed runs. Autoregressive decoding of the same target runs on the same
prompts in the same call; the speed-up is the ratio of throughputs per prompt set. Metrics
are defined in ``mtpc.evaluation.metrics``.
"""

from __future__ import annotations

import gc
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mtpc.decoding import DRAFT_MODES, POLICIES, GenerationResult, generate
from mtpc.evaluation.metrics import aggregate, set_metrics
from mtpc.evaluation.report import format_table, write_outputs

TRAIN_HINT = "train one with `python train.py` or pass draft=<exported draft dir>"


class EvalConfigError(ValueError):
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
    for field in ("greedy", "suppress_eos", "max_throughput", "english_only", "plots"):
        choice(field, (True, False))
    for field, low in (("warmup", 0), ("num_threads", 1), ("top_k", 1), ("max_prompt_length", 1)):
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
    device = str(_get(cfg, "device", "cpu"))
    if device != "cpu" and not device.startswith("cuda"):
        raise EvalConfigError(f"device={device!r} is not allowed; allowed: cpu, cuda, cuda:<i>")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalConfigError(
            f"device={device!r} is not allowed: CUDA is not available; allowed: cpu"
        )


def _root(cfg: Any) -> Path:
    root = _get(cfg, "paths.root_dir")
    return Path(root) if root else Path(__file__).resolve().parents[2]


def resolve_drafts(cfg: Any) -> list[Path]:
    """The drafts to evaluate: ``draft`` (a dir or a list), else the last trained one.

    Raises:
        FileNotFoundError: no draft given and ``outputs/last_draft.txt`` is missing, or a
            draft folder does not exist; the message says how to make one.
    """
    draft = _get(cfg, "draft")
    if draft is None:
        marker = _root(cfg) / "outputs" / "last_draft.txt"
        if not marker.is_file():
            raise FileNotFoundError(f"no draft given and {marker} does not exist: {TRAIN_HINT}")
        draft = marker.read_text(encoding="utf-8").strip()
    paths = [draft] if isinstance(draft, str | Path) else list(draft)
    out = []
    for p in paths:
        path = Path(str(p))
        if not path.is_absolute():
            path = _root(cfg) / path
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"draft={p} is not an exported draft folder (no config.json); {TRAIN_HINT}"
            )
        out.append(path)
    return out


def load_target(cfg: Any) -> Any:
    """The configured target (``model=``) as a backbone on ``device``."""
    from mtpc.backbones import load_backbone

    return load_backbone(
        str(_get(cfg, "model.name", "tiny")),
        path=_get(cfg, "model.path"),
        revision=_get(cfg, "model.revision"),
        dtype=_get(cfg, "model.dtype", "float32"),
        device=str(_get(cfg, "device", "cpu")),
    )


def load_for_eval(path: Path, cfg: Any) -> Any:
    """Loads a draft against the configured target (``model=``), refusing another target.

    Raises:
        ValueError: the draft names another registry target than ``model.name``.
        TargetMismatchError: the target's weights differ from the recorded fingerprint.
    """
    from mtpc.backbones import BACKBONES
    from mtpc.export import read_config
    from mtpc.model import MTPCModel

    recorded = read_config(path)["target"].get("model")
    name = _get(cfg, "model.name", "tiny")
    device = str(_get(cfg, "device", "cpu"))
    if recorded in BACKBONES and recorded != name:
        raise ValueError(
            f"draft {path} was exported for target model {recorded!r}, but model={name}; "
            f"evaluate it with model={recorded}"
        )
    if recorded == name:
        return MTPCModel.from_pretrained(path, target=load_target(cfg))
    return MTPCModel.from_pretrained(path, device=device)  # an HF target rebuilt from its path


def load_prompt_sets(cfg: Any, codec: str, max_prompt_length: int | None) -> list[list[Any]]:
    """Evaluation prompt sets from the data pipeline's validation split."""
    from hydra.utils import instantiate

    data = _get(cfg, "data")
    module = instantiate(data, codec=codec) if data is not None else None
    if module is None:
        from mtpc.data.datamodule import build_datamodule

        module = build_datamodule(codec=codec)
    seed = int(_get(cfg, "seed", 0))
    sets = int(_get(cfg, "num_prompt_sets", 1))
    return module.prompt_sets(
        num_prompts=int(_get(cfg, "num_prompts", 8)),
        seeds=tuple(range(seed, seed + sets)),
        english_only=bool(_get(cfg, "english_only", True)),
        max_prompt_length=max_prompt_length,
    )


def _sync_memory_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def decode_sets(
    model: Any, prompt_sets: Sequence[Sequence[Any]], cfg: Any, **overrides: Any
) -> list[list[GenerationResult]]:
    """Decodes every prompt of every set after ``warmup`` untimed runs."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": int(_get(cfg, "max_new_tokens", 128)),
        "greedy": bool(_get(cfg, "greedy", True)),
        "policy": _get(cfg, "policy", "condition"),
        "draft_mode": _get(cfg, "draft_mode"),
        "temperature": float(_get(cfg, "temperature", 1.0)),
        "top_k": _get(cfg, "top_k"),
        "top_p": _get(cfg, "top_p"),
        "suppress_eos": bool(_get(cfg, "suppress_eos", True)),
    }
    kwargs.update(overrides)
    seed = int(_get(cfg, "seed", 0))
    first = prompt_sets[0][0].prompt_ids
    for w in range(int(_get(cfg, "warmup", 1))):
        generate(model, first, seed=seed + w, **kwargs)
    return [
        [generate(model, p.prompt_ids, seed=seed + i, **kwargs) for i, p in enumerate(prompts)]
        for prompts in prompt_sets
    ]


def _row(name: str, per_set: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    row = {"name": name, **extra, **aggregate(per_set)}
    row["per_set"] = per_set
    return row


def _ratio(per_set: list[dict[str, Any]], ref: list[dict[str, Any]]) -> list[float]:
    return [a["tok_s"] / b["tok_s"] for a, b in zip(per_set, ref, strict=True) if b["tok_s"] > 0]


def evaluate(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Evaluates the configured drafts; prints the table, writes results and plots.

    Returns:
        ``{"rows": [AR row, draft rows..., baseline row], "table": str, "files": {...},
        "settings": {...}}``; each row has mu_lat, mu_acc, mu_acc_drafts, tok_s, max_tok_s,
        speedup_ar, speedup_baseline (mean and ``*_std`` over prompt sets), peak memory and
        the acceptance per window position.
    """
    from mtpc.config import validate_eval_config
    from mtpc.evaluation.metrics import mean_std
    from mtpc.export import read_config

    validate_eval_config(cfg)
    check_eval_fields(cfg)
    drafter = _get(cfg, "drafter")
    # drafter=hetero alone evaluates only the other-vocabulary drafter; with draft= both
    drafts = resolve_drafts(cfg) if drafter is None or _get(cfg, "draft") else []
    baseline = _get(cfg, "baseline")
    base_paths = (
        resolve_drafts({"draft": baseline, "paths": _get(cfg, "paths")}) if baseline else []
    )
    device = str(_get(cfg, "device", "cpu"))
    threads = _get(cfg, "num_threads")
    if threads:
        torch.set_num_threads(int(threads))
    configs = [read_config(p) for p in drafts + base_paths]
    codec = configs[0]["codec"] if configs else str(_get(cfg, "model.codec", "tiny"))
    windows = [c["circuit"]["window"] for c in configs] or [0]
    new = int(_get(cfg, "max_new_tokens", 128))

    rows: list[dict[str, Any]] = []
    prompt_sets: list[list[Any]] | None = None
    ar_sets: list[dict[str, Any]] = []
    for i, path in enumerate(drafts + base_paths):
        model = load_for_eval(path, cfg)
        if prompt_sets is None:  # the target's context bounds the prompts
            context = getattr(model.backbone.config, "max_position_embeddings", None)
            limit = _get(cfg, "max_prompt_length")
            if context:
                fit = int(context) - new - max(windows)
                limit = fit if limit is None else min(int(limit), fit)
            prompt_sets = load_prompt_sets(cfg, codec, limit)
            _sync_memory_reset(device)
            ar = decode_sets(model, prompt_sets, cfg, method="autoregressive")
            ar_sets = [set_metrics(s) for s in ar]
            rows.append(
                _row("AR (target)", ar_sets, kind="ar", peak_memory_mb=_peak_memory_mb(device))
            )
        c = configs[i]["circuit"]
        n = c["window"]
        _sync_memory_reset(device)
        sd = decode_sets(model, prompt_sets, cfg)
        per_set = [set_metrics(s, n) for s in sd]
        for m, ref in zip(per_set, ar_sets, strict=True):
            m["speedup_ar"] = m["tok_s"] / ref["tok_s"] if ref["tok_s"] > 0 else float("nan")
        if _get(cfg, "max_throughput", True):
            mx = decode_sets(model, prompt_sets, cfg, max_throughput=True)
            for m, s in zip(per_set, mx, strict=True):
                m["max_tok_s"] = set_metrics(s, n)["tok_s"]
        row = _row(
            Path(path).name if Path(path).name != "draft" else Path(path).parent.name,
            per_set,
            path=str(path),
            kind=c["kind"],
            window=n,
            rank=c["rank"],
            lora_layers=configs[i]["lora"]["layers"],
            policy=_get(cfg, "policy", "condition"),
            draft_mode=sd[0][0].draft_mode,
            baseline=i >= len(drafts),
            peak_memory_mb=_peak_memory_mb(device),
        )
        for key in ("speedup_ar", "max_tok_s"):
            if all(key in m for m in per_set):
                row[key], row[f"{key}_std"] = mean_std([m[key] for m in per_set])
        rows.append(row)
        del model
        gc.collect()
    if drafter is not None:
        if prompt_sets is None:
            prompt_sets = load_prompt_sets(cfg, codec, _get(cfg, "max_prompt_length"))
        rows.extend(hetero_rows(cfg, prompt_sets, with_ar=not rows))
    if base_paths:
        ref_sets = rows[-1]["per_set"]
        for row in rows[1:]:
            row["speedup_baseline"], row["speedup_baseline_std"] = mean_std(
                _ratio(row["per_set"], ref_sets)
            )

    greedy = bool(_get(cfg, "greedy", True))
    title = (
        f"{'greedy' if greedy else 'sampling'} | policy={_get(cfg, 'policy', 'condition')} | "
        f"{len(prompt_sets or [])} set(s) x {_get(cfg, 'num_prompts', 8)} prompts x {new} bytes | "
        f"device={device} | mu_acc counts the kept correction/bonus token"
    )
    table = format_table(rows, title)
    print(table)
    settings = {
        k: _get(cfg, k)
        for k in (
            "greedy", "policy", "draft_mode", "temperature", "top_k", "top_p", "num_prompts",
            "num_prompt_sets", "max_new_tokens", "warmup", "suppress_eos", "max_throughput",
            "device", "english_only", "seed", "num_threads",
        )
    }  # fmt: skip
    results: dict[str, Any] = {"settings": settings, "rows": rows, "table": table}
    try:
        out_dir = _get(cfg, "output_dir")
    except Exception:  # ${hydra:...} outside a Hydra run
        out_dir = None
    if out_dir is None:
        out_dir = _root(cfg) / "outputs" / "eval" / "latest"
    results["files"] = write_outputs(results, Path(out_dir), plots=bool(_get(cfg, "plots", True)))
    print(f"results: {results['files']['json']}")
    return results


def hetero_rows(cfg: Any, prompt_sets: list[list[Any]], with_ar: bool) -> list[dict[str, Any]]:
    """Rows for ``drafter=hetero``: the configured target drafted by another vocabulary.

    Each prompt set is decoded by :func:`mtpc.evaluation.hetero.evaluate_hetero` (AR and
    the drafter in the same call, so ``x AR`` compares like with like); rows hold the
    mean and std over sets, as the self-speculative rows do. The vocabulary overlap
    (Timor et al., Tables 5-6) goes into the row's ``overlap``.
    """
    from mtpc.backbones.codecs import get_codec
    from mtpc.evaluation.hetero import evaluate_hetero, load_drafter
    from mtpc.evaluation.metrics import mean_std

    device = str(_get(cfg, "device", "cpu"))
    backbone = load_target(cfg)
    codec = get_codec(str(_get(cfg, "model.codec", "tiny")))
    model, tokenizer = load_drafter(
        str(_get(cfg, "drafter.model")), _get(cfg, "drafter.tokenizer"), device=device
    )
    options = {key: _get(cfg, f"drafter.{key}") for key in ("look_behind", "max_psi_paths", "psi")}
    if not _get(cfg, "greedy", True):
        options.update({k: _get(cfg, k) for k in ("temperature", "top_k", "top_p")})
    results = [
        evaluate_hetero(
            backbone.hf_model,
            codec,
            model,
            tokenizer,
            prompts=[p.prompt_ids for p in prompt_set],
            algorithm=str(_get(cfg, "drafter.algorithm", "slem")),
            lookahead=int(_get(cfg, "drafter.lookahead", 5)),
            greedy=bool(_get(cfg, "greedy", True)),
            seed=int(_get(cfg, "seed", 0)) + index,
            max_new_tokens=int(_get(cfg, "max_new_tokens", 128)),
            warmup=int(_get(cfg, "warmup", 1)),
            **{k: v for k, v in options.items() if v is not None},
        )
        for index, prompt_set in enumerate(prompt_sets)
    ]
    rows = []
    for position in (0, 1) if with_ar else (1,):
        per_set = [r["rows"][position] for r in results]
        row = _row(per_set[0]["name"], per_set, kind=per_set[0]["kind"])
        if position == 1:
            row["overlap"] = results[0]["overlap"]
            row["speedup_ar"], row["speedup_ar_std"] = mean_std([m["speedup_ar"] for m in per_set])
        rows.append(row)
    return rows
