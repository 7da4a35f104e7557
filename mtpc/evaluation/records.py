"""The evaluation folder: its manifest, its streamed per-prompt records, resume and merging
(docs/EVALUATION.md, "One folder per evaluation" and "Records"). A SIGKILL loses at most the
line being written; :meth:`RecordStore.open` drops such a partial last line before appending.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mtpc.errors import UserError
from mtpc.files import BadJsonLine, read_json_lines
from mtpc.store import AppendStore, changed, dumps, write_json

RECORDS = "records.jsonl"
MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT_VERSION = 1
IDENTITY = ("settings", "target", "data", "drafts", "device_name")
"""Manifest fields that must agree to resume a folder (and, but ``drafts``, to merge)."""


class RecordsError(UserError, ValueError):
    """A folder that cannot be resumed or merged; the message names the fields and the fix."""


def draft_fingerprint(path: Path) -> str:
    """A fast fingerprint of an exported draft: its config.json and its head file's size and
    ends (a re-export into the same folder changes it, so its records are not reused)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for head in sorted(path.glob("*.safetensors")):
        size = head.stat().st_size
        h.update(f"{head.name}:{size}".encode())
        with open(head, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def identity(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a manifest that define what was measured (:data:`IDENTITY`)."""
    return {k: manifest.get(k) for k in IDENTITY}


def folder_name(manifest: Mapping[str, Any]) -> str:
    """``<drafts>-<greedy|sampling>-<sets>x<prompts>x<bytes>-<key>`` (key: the identity's hash)."""
    key = hashlib.sha256(dumps(identity(manifest), sort_keys=True).encode()).hexdigest()[:10]
    drafts = [d["name"] for d in manifest["drafts"]] or ["ar"]
    label = drafts[0] + (f"+{len(drafts) - 1}" if len(drafts) > 1 else "")
    label = re.sub(r"[^A-Za-z0-9_.+-]+", "_", label)[:48]
    s = manifest["settings"]
    mode = "greedy" if s.get("greedy", True) else "sampling"
    prompts = s.get("num_prompts")
    data = manifest.get("data") or {}
    if data.get("prompts") == "spec_bench":  # Spec-Bench's questions (null: all selected)
        mode += "-specbench"
        prompts = prompts or data.get("questions")
    shape = f"{s.get('num_prompt_sets')}x{prompts}x{s.get('max_new_tokens')}"
    return f"{label}-{mode}-{shape}-{key}"


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every complete record of ``folder`` (a partial last line, from a kill, is skipped);
    RecordsError when another line does not parse."""
    try:
        return [_current(record) for record in read_json_lines(folder / RECORDS)]
    except BadJsonLine as bad:
        raise RecordsError(
            f"{bad.path}:{bad.number} is not a JSON record; remove that line"
        ) from None


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of an evaluation folder (RecordsError when there is none)."""
    path = folder / MANIFEST
    if not path.is_file():
        raise RecordsError(f"{folder} is not an evaluation folder (no {MANIFEST})")
    manifest = dict(json.loads(path.read_text(encoding="utf-8")))
    for draft in manifest.get("drafts", []):
        _current(draft)
    return manifest


def _current(entry: dict[str, Any]) -> dict[str, Any]:
    """An older folder's entry (a record, a manifest's draft) with its ``draft_mode`` read as
    ``draft_rule`` (the key's name until the drafting choices had one name each)."""
    if "draft_mode" in entry:
        entry["draft_rule"] = entry.pop("draft_mode")
    return entry


def record_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a prompt record measured: (draft path, pass, set, index)."""
    return (record.get("draft_path"), record["pass"], record["set"], record["index"])


def turn_hashes(record: Mapping[str, Any]) -> list[str]:
    """``tokens_sha1`` of each turn of a prompt record (one for a single-turn prompt)."""
    turns = record.get("turns")
    return [t["tokens_sha1"] for t in turns] if turns else [record["tokens_sha1"]]


def ar_turn_hashes(records: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], list[str]]:
    """AR's :func:`turn_hashes` by (set, index): the greedy check's reference."""
    return {
        (r["set"], r["index"]): turn_hashes(r)
        for r in records
        if r.get("type") == "prompt" and r["pass"] == "ar" and r.get("draft_path") is None
    }


def equal_turns(hashes: Sequence[str], reference: Sequence[str]) -> list[bool]:
    """Per turn: whether its ``tokens_sha1`` equals the reference's (AR's) same turn."""
    return [j < len(reference) and reference[j] == h for j, h in enumerate(hashes)]


class MemoryRecords:
    """Prompt records held in memory (``records``, in order; ``done``: the :func:`record_key`
    of each prompt record), and what is still to decode. :class:`RecordStore` adds the folder."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self.records: list[dict[str, Any]] = list(records)
        self.done = {record_key(r) for r in self.records if r.get("type") == "prompt"}

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if record.get("type") == "prompt":
            self.done.add(record_key(record))

    def pending(
        self, prompt_sets: Sequence[Sequence[Any]], draft_path: str | None, pass_name: str
    ) -> list[tuple[int, int, Any]]:
        """``(set, index, prompt)`` of every prompt not yet recorded for this draft and pass."""
        return [
            (k, i, p)
            for k, prompts in enumerate(prompt_sets)
            for i, p in enumerate(prompts)
            if (draft_path, pass_name, k, i) not in self.done
        ]


class RecordStore(MemoryRecords, AppendStore):
    """An evaluation folder open for appending records; ``manifest`` has this session's
    provenance appended to ``sessions``."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        AppendStore.__init__(self)
        self.folder = folder
        self.manifest = manifest

    @classmethod
    def open(cls, folder: Path, manifest: dict[str, Any], force: bool = False) -> RecordStore:
        """Opens (or creates) ``folder`` for ``manifest`` (``identity`` fields plus ``sessions``);
        RecordsError when another evaluation holds it or (unless ``force``) differs."""
        store = cls(folder, manifest)
        store.lock(
            folder / LOCK,
            lambda busy: RecordsError(
                f"another evaluation is writing to {folder} ({busy.holder}); wait for it or "
                "use another output_dir"
            ),
        )
        if (folder / MANIFEST).is_file():
            old = read_manifest(folder)
            diff = changed(old, manifest, IDENTITY)
            if diff and not force:
                store.close()
                raise RecordsError(
                    f"{folder} holds records of another evaluation; changed: "
                    + "; ".join(diff)
                    + ". Use another output_dir (or none: each evaluation gets its own folder),"
                    " or resume=force to add to these records anyway."
                )
            sessions = old.get("sessions", []) + manifest["sessions"]
            store.manifest = {**manifest, "sessions": sessions}
        write_json(folder / MANIFEST, store.manifest)
        store.open_lines(folder / RECORDS)
        MemoryRecords.__init__(store, read_records(folder))
        return store

    def append(self, record: dict[str, Any]) -> None:
        """Appends one record and flushes it to the OS (it survives a kill of this process)."""
        self.write_line(self.folder / RECORDS, record)
        super().append(record)


def hetero_draft_path(drafter: Mapping[str, Any]) -> str:
    """The ``draft_path`` of a ``drafter=hetero`` evaluation's records: ``drafter:<model>``."""
    return f"drafter:{drafter.get('model')}"


def check_mergeable(manifests: Sequence[Mapping[str, Any]], folders: Sequence[Path]) -> None:
    """Refuses (RecordsError) to merge folders measured differently (but in their drafts) or
    holding the same draft."""
    keys = [k for k in IDENTITY if k != "drafts"]
    seen: dict[str, Path] = {}
    for manifest, folder in zip(manifests, folders, strict=True):
        diff = changed(manifests[0], manifest, keys)
        if diff:
            raise RecordsError(
                f"cannot merge {folders[0]} and {folder}: measured differently; " + "; ".join(diff)
            )
        drafter = manifest["settings"].get("drafter")  # drafter=hetero: its rows, once
        paths = [d["path"] for d in manifest["drafts"]]
        for path in paths + ([hetero_draft_path(drafter)] if drafter else []):
            if path in seen:
                raise RecordsError(
                    f"cannot merge: draft {path} was evaluated in both {seen[path]} "
                    f"and {folder}; keep one of the folders"
                )
            seen[path] = folder


def expand_folders(patterns: Iterable[str], root: Path) -> list[Path]:
    """Evaluation folders named by paths or glob patterns (relative to ``root``), in order;
    RecordsError when a pattern matches none."""
    out: list[Path] = []
    for pattern in patterns:
        base = root / pattern  # an absolute pattern stays itself
        if any(c in pattern for c in "*?["):
            anchor = Path(base.anchor)
            matches = sorted(p for p in anchor.glob(str(base.relative_to(anchor))) if p.is_dir())
        else:
            matches = [base]
        found = [p for p in matches if (p / MANIFEST).is_file()]
        if not found:
            raise RecordsError(f"report={pattern}: no evaluation folder (with {MANIFEST}) there")
        out += [p for p in found if p not in out]
    return out
