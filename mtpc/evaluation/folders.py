"""An evaluation's folder: the manifest that defines what is measured (its key names the
folder), a fresh folder for ``resume=never``, and the check that its prompts are the same."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtpc.evaluation.drafting import asked, chain_rule
from mtpc.evaluation.loading import check_target_name, spec_bench_path, spec_bench_questions
from mtpc.evaluation.records import (
    FORMAT_VERSION,
    MANIFEST,
    RecordsError,
    RecordStore,
    draft_fingerprint,
    folder_name,
)
from mtpc.evaluation.settings import IDENTITY_FIELDS, EvalSettings, name_list
from mtpc.evaluation.statistics import training_config

logger = logging.getLogger(__name__)

DATA_IGNORED = ("cache_dir", "num_workers", "batch_size", "streaming", "pack_documents")
"""Data fields that do not change the prompts."""


def build_manifest(
    settings: EvalSettings | Any, drafts: Sequence[Path], baselines: Sequence[Path]
) -> dict[str, Any]:
    """What an evaluation measures (settings, target, data, drafts, device) and its provenance
    (``settings`` may be a raw config: read first, as ``evaluate`` does)."""
    from mtpc.export import read_config
    from mtpc.store import device_name, provenance

    s = settings if isinstance(settings, EvalSettings) else EvalSettings.from_cfg(settings)
    d = s.decoding
    entries = []
    for i, path in enumerate([*drafts, *baselines]):
        check_target_name(path, s.model.name)
        config = read_config(path)
        c = config["circuit"]
        # the rule each draft decodes with: a change of the per-family default is another
        # measurement (another folder), never resumed into the old records
        rule = chain_rule(c["kind"], bool(d.greedy), d.drafting, d.proposal)
        entries.append(
            {"path": str(path), "name": path.parent.name if path.name == "draft" else path.name,
             "kind": c["kind"], "window": c["window"], "rank": c["rank"],
             "lora_layers": config["lora"]["layers"], "baseline": i >= len(drafts),
             "fingerprint": draft_fingerprint(path), "draft_rule": rule}
        )  # fmt: skip
    data = dict(s.data or {})
    device = str(s.run.device)
    # the settings as given (not as defaulted): the same bytes, the same folder key
    settings_record = {k: s.given.get(k) for k in IDENTITY_FIELDS}
    settings_record.update(asked(d.drafting, d.proposal))
    if s.drafter is not None:  # drafter=hetero: another drafter, another folder
        settings_record["drafter"] = dict(s.drafter.fields)
    if s.run.interleave:  # another timing protocol, another folder
        settings_record["interleave"] = True
    if s.run.batch_size > 1:  # times are a batch's shares: another protocol, another folder
        settings_record["batch_size"] = s.run.batch_size
    if s.decoding.compile is not False:  # another AR engine: another baseline, another folder
        settings_record["compile"] = s.decoding.compile
    settings_record["sources"] = name_list(settings_record["sources"])
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "settings": settings_record,
        "target": dict(s.model.fields),
        "data": {k: v for k, v in data.items() if k not in DATA_IGNORED},
        "drafts": entries,
        "device_name": device_name(device),
        "sessions": [provenance(device, s.output.root_dir)],
    }
    # each draft's training config (its model card's; outside the identity): report= merges
    # drafts that differ only in their seed (mtpc.evaluation.statistics.seed_rows)
    manifest["training"] = {str(p): training_config(p) for p in [*drafts, *baselines]}
    spec = spec_bench_questions(s)
    if spec is None or s.prompts.spec_bench is None:
        warn_other_data(manifest["training"], str(data.get("source")))
    else:  # the prompts are the file's (its content, not its path, is the key)
        bench = s.prompts.spec_bench
        manifest["data"] = {
            "prompts": "spec_bench", "file": spec_bench_path(bench.path, s.output.root_dir).name,
            "sha256": spec[1], "categories": name_list(bench.categories),
            "per_category": bench.per_category, "turns": bench.turns,
            "questions": len(spec[0]),
        }  # fmt: skip
        manifest["prompt_file"] = str(spec_bench_path(bench.path, s.output.root_dir))
    return manifest


def warn_other_data(training: Mapping[str, Any], source: str) -> list[str]:
    """Warns (once per draft) when a draft was trained on another named data source than the
    prompts come from (allowed, but said); returns the paths warned about. Drafts trained on
    local files or without a recorded config are not checked."""
    warned = []
    for path, config in training.items():
        trained = ((config or {}).get("data") or {}).get("source")
        if trained and trained != "local" and trained != source:
            logger.warning(
                "%s was trained on data.source=%s but the prompts come from data.source=%s; "
                "pass data=%s to evaluate it on its own data", path, trained, source, trained,
            )  # fmt: skip
            warned.append(path)
    return warned


def eval_folder(s: EvalSettings, manifest: Mapping[str, Any]) -> Path:
    """``output_dir`` when given, else ``outputs/eval/<name from the drafts and settings>``."""
    out = s.output.output_dir
    return Path(out) if out else s.output.root_dir / "outputs" / "eval" / folder_name(manifest)


def check_prompts(store: RecordStore, prompt_sets: Sequence[Sequence[Any]]) -> None:
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


def fresh_folder(folder: Path) -> Path:
    """``folder`` if it holds no evaluation yet, else the first free ``<folder>-<k>``, k >= 2."""
    candidate, k = folder, 2
    while (candidate / MANIFEST).exists() or (candidate.exists() and any(candidate.iterdir())):
        candidate, k = folder.with_name(f"{folder.name}-{k}"), k + 1
    return candidate
