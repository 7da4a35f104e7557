"""Sequence-level self-distillation (``scripts/regenerate.py``): the target rewrites the
assistant turns of training rows into an append-only folder (``mtpc.store.AppendStore``; its
files, resume, sharding and refusals: docs/DATA.md, "Self-distillation"). Each turn draws from
its own seed (:func:`turn_seed`), so a resumed or re-sharded row equals an uninterrupted one.
Settings: :class:`RegenerateSettings`, checked once at the door (:func:`parse_regenerate`),
each default as in ``configs/regenerate.yaml``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from mtpc.backbones import check_batch_size
from mtpc.backbones.codecs import ByteCodec
from mtpc.choices import SAMPLING_POLICIES
from mtpc.config import (
    ConfigError,
    DataChecks,
    ModelSettings,
    checked_as,
    choice,
    flag,
    given,
    integer,
    number,
    read,
    rule,
    section,
    setting,
)
from mtpc.data.preprocess import check_row
from mtpc.decoding.settings import CONFIG, check_drafting, check_settings
from mtpc.errors import UserError
from mtpc.evaluation.loading import load_target
from mtpc.evaluation.settings import BATCH_SIZE, CHUNK_BATCHES, check_batch, refusing
from mtpc.files import BadJsonLine, read_json_lines
from mtpc.store import AppendStore, changed, provenance, write_json

# ------------------------------------------------------------------------ the schema ----
DRAFT_FOLDER = rule(
    lambda v: isinstance(v, str) and (Path(v).expanduser() / "config.json").is_file(),
    "an exported draft folder (with config.json, e.g. outputs/train/<run>/draft) or null "
    "(autoregressive)",
    null=True,
)


def _absolute(path: Any) -> str | None:
    return str(Path(path).expanduser().resolve()) if path else None


def _method(draft: Any) -> str:
    return "speculative" if draft else "autoregressive"


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Settings:
    """How every assistant turn of a regeneration is decoded (part of the manifest's identity;
    fields: configs/regenerate.yaml). ``method`` speculative needs ``draft``."""

    method: str = setting("autoregressive", key="draft", convert=_method)  # draft=: speculative
    draft: str | None = setting(None, DRAFT_FOLDER, convert=_absolute)
    greedy: bool = setting(True, flag())
    temperature: float = setting(1.0, number(0.0, low_open=True, null=False), convert=float)
    top_k: int | None = setting(None, integer(1, null=True))
    top_p: float | None = setting(
        None, number(0.0, 1.0, low_open=True, high_open=False), convert=_float
    )
    max_new_tokens: int = setting(1024, integer(1))
    seed: int = setting(0, integer(0))
    policy: str = setting("condition", choice(*SAMPLING_POLICIES))
    drafting: str | None = None
    proposal: str | None = None
    compile: Any = False  # the engine (autoregressive and chains): not the rows' law

    def output_law(self) -> dict[str, Any]:
        """The settings that decide what is written (not how fast): the manifest's identity.
        The decoder (method, draft, policy, mode) is lossless: greedy rows are the same bytes
        without it; sampled rows only the same in distribution (not per seed), so they keep it."""
        keys: tuple[str, ...] = ("greedy", "max_new_tokens", "seed")
        if not self.greedy:  # the sampling parameters, then the decoder
            keys += ("temperature", "top_k", "top_p")
            keys += ("method", "draft", "policy", "drafting", "proposal")
        return {k: getattr(self, k) for k in keys}


#: The ``data.*`` fields a regeneration reads (manifest ``data``, plus source fingerprint and name)
REGENERATE_DATA = ("source", "path", "num_rows", "seed", "streaming", "revision", "hf_name")


@dataclass(frozen=True)
class RegenerateSettings:
    """Everything a regeneration reads from its config, read and checked once (a bad field:
    ``ConfigError``). ``data``: the fields of :data:`REGENERATE_DATA` (None where missing);
    ``output_dir`` empty: ``outputs/regenerate/<model>-<data source>-<greedy | t<T>>-seed<seed>``;
    ``root_dir`` None: the working directory; ``batch_size`` is not part of the manifest (the
    rows do not depend on it)."""

    decoder: Settings = section(Settings)
    model: ModelSettings = section(ModelSettings, "model")
    data: Mapping[str, Any] = setting(
        {}, checked_as(DataChecks), convert=lambda d: {k: (d or {}).get(k) for k in REGENERATE_DATA}
    )
    shard: int = setting(0, integer(0))
    num_shards: int = setting(1, integer(1))
    output_dir: str = setting("", or_default=True)  # "" or null: the folder above
    root_dir: str | None = setting(None, key="paths.root_dir")
    device: str = setting("cpu", rule(lambda v: isinstance(v, str), "cpu, cuda[:i]"))
    num_threads: int | None = setting(1, integer(1, null=True))
    progress: bool = True
    batch_size: int = setting(1, BATCH_SIZE)

    def __post_init__(self) -> None:
        if self.shard >= self.num_shards:
            raise ConfigError(
                f"shard={self.shard} is not allowed with num_shards={self.num_shards}; "
                f"allowed: an integer in 0..{self.num_shards - 1}"
            )
        d = self.decoder
        with refusing(ConfigError):  # as mtpc.generate checks them, in the config's spelling
            check_drafting(d.greedy, d.drafting, d.proposal, spell=CONFIG)
            check_settings(CONFIG, method=d.method, compile=d.compile)  # the engine
        check_batch(self.batch_size, str(self.model.name), ConfigError)

    @classmethod
    def from_cfg(cls, cfg: Any) -> RegenerateSettings:
        """Every field a regeneration uses, checked."""
        s = read(cls, cfg)
        if s.output_dir:
            return s
        d, written = s.decoder, given(cfg, ("temperature",))["temperature"]
        mode = "greedy" if d.greedy else f"t{written or d.temperature}"  # as the config writes it
        source = "path" if s.data.get("path") else s.data.get("source") or "synthetic"
        name = f"{s.model.name}-{source}-{mode}-seed{d.seed}"
        folder = Path(s.root_dir or ".") / "outputs" / "regenerate" / name
        return dataclasses.replace(s, output_dir=str(folder))


# ``regenerate``'s door: the config read and checked once, before anything loads
parse_regenerate = RegenerateSettings.from_cfg


FORMAT_VERSION = 1
#: Manifest fields that must agree between a folder's shards and on resume.
IDENTITY = ("format", "target", "settings", "data", "num_shards")


class RegenerateMismatchError(UserError, ValueError):
    """The output folder holds rows made with another target, settings, data or sharding."""


class RegenerateBusyError(UserError, RuntimeError):
    """Another process is writing the same shard."""


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The seed of assistant turn ``turn`` of source row ``index`` (independent of sharding)."""
    digest = hashlib.sha256(f"mtpc-regenerate:{seed}:{index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits


@dataclass
class RowResult:
    """One source row (``index``: its position in the source): the row to write, or the
    reason it was skipped."""

    index: int
    row: dict[str, Any] | None = None
    reason: str | None = None


def _usable(row: Any) -> str | None:
    """``check_row``'s reason, ignoring what regeneration replaces (empty assistant turns)."""
    if isinstance(row, Mapping) and isinstance(row.get("messages"), list):
        messages = [
            {**m, "content": "-"}
            if isinstance(m, Mapping) and m.get("role") == "assistant" and m.get("content") == ""
            else m
            for m in row["messages"]
        ]
        row = {**row, "messages": messages}
    reason = check_row(row)
    return None if reason == "empty_assistant_turn" else reason


def regenerate_row(
    model: Any,
    codec: ByteCodec,
    row: Mapping[str, Any],
    index: int,
    settings: Settings,
    context: int | None,
) -> RowResult:
    """:func:`regenerate_rows` of one row."""
    return regenerate_rows(model, codec, [(index, row)], settings, context)[0]


class _Turns:
    """One source row on its way through its assistant turns."""

    def __init__(self, index: int, row: Mapping[str, Any]) -> None:
        self.index, self.row = index, row
        self.reason = _usable(row)
        self.messages = list(row["messages"]) if self.reason is None else []
        self.history: list[dict[str, str]] = []
        self.truncated: list[bool] = []
        self.new_tokens: list[int] = []
        self.byte_exact: list[bool] = []

    def next_turn(self) -> bool:
        """Copies the turns up to the next assistant turn; False when none is left."""
        while self.reason is None and self.messages:
            message = self.messages.pop(0)
            role, content = str(message["role"]), str(message["content"])
            if role == "assistant":
                return True
            self.history.append({"role": role, "content": content})
        return False

    def answer(self, codec: ByteCodec, result: Any) -> None:
        """Appends the target's turn (its stop id left out)."""
        body = result.tokens[:-1] if result.stopped else result.tokens
        text = codec.decode(body)
        self.history.append({"role": "assistant", "content": text})
        self.truncated.append(not result.stopped)
        self.new_tokens.append(len(result.tokens))
        # False where the text does not re-encode to the generated ids: a special id inside
        # the turn, or bytes that are not UTF-8 (decoded as U+FFFD).
        self.byte_exact.append(codec.encode(text) == list(body))

    def result(self) -> RowResult:
        if self.reason is not None:
            return RowResult(self.index, reason=self.reason)
        out = {
            "id": str(self.row.get("id") or f"row-{self.index}"),
            "source": str(self.row.get("source") or "unknown"),
            "messages": self.history,
            "regenerated": {"index": self.index, "truncated": self.truncated,
                            "new_tokens": self.new_tokens, "byte_exact": self.byte_exact},
        }  # fmt: skip
        return RowResult(self.index, row=out)


def regenerate_rows(
    model: Any,
    codec: ByteCodec,
    rows: Sequence[tuple[int, Mapping[str, Any]]],
    settings: Settings,
    context: int | None,
    batch_size: int = 1,
) -> list[RowResult]:
    """Rewrites every assistant turn of each ``(source index, row)`` with the target, in order
    (the rows' k-th turns decoded together, ``batch_size`` at once); per row, the regenerated
    row or why it was skipped. ``context``: the target's context length (None: unbounded)."""
    from mtpc.decoding import generate

    lookahead = model.head.circuit.window if settings.method == "speculative" else 0
    states = [_Turns(index, row) for index, row in rows]
    going = [state for state in states if state.next_turn()]
    while going:
        groups: dict[int, list[tuple[_Turns, list[int]]]] = {}
        for state in going:
            prompt = codec.generation_prompt(state.history)  # (T,) ids
            budget = settings.max_new_tokens
            if context is not None:
                budget = min(budget, context - len(prompt) - lookahead)
            if budget < 1:
                state.reason = "prompt_too_long"
            else:  # one call per budget (a prompt near the context has less room)
                groups.setdefault(budget, []).append((state, prompt))
        for budget, group in groups.items():
            results = generate(
                model, [prompt for _, prompt in group], budget, method=settings.method,
                greedy=settings.greedy,
                seed=[turn_seed(settings.seed, s.index, len(s.truncated)) for s, _ in group],
                policy=settings.policy, draft=settings.drafting, proposal=settings.proposal,
                temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                stop_ids=codec.stop_ids, batch_size=min(batch_size, len(group)),
                compile=settings.compile,
            )  # fmt: skip
            assert isinstance(results, list)
            for (state, _), result in zip(group, results, strict=True):
                state.answer(codec, result)
        going = [state for state in going if state.next_turn()]
    return [state.result() for state in states]


@dataclass
class Counts:
    """What one shard holds: rows written, skipped by reason, turns truncated."""

    written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    truncated_rows: int = 0
    truncated_turns: int = 0
    turns: int = 0
    new_tokens: int = 0
    not_byte_exact_turns: int = 0
    empty_turns: int = 0

    def add(self, result: RowResult) -> None:
        if result.row is None:
            self.skipped[str(result.reason)] += 1
            return
        meta = result.row["regenerated"]
        self.written += 1
        self.truncated_rows += any(meta["truncated"])
        self.truncated_turns += sum(meta["truncated"])
        self.turns += len(meta["truncated"])
        self.new_tokens += sum(meta["new_tokens"])
        self.not_byte_exact_turns += sum(not b for b in meta["byte_exact"])
        self.empty_turns += sum(
            1 for m in result.row["messages"] if m["role"] == "assistant" and not m["content"]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["skipped"] = dict(sorted(self.skipped.items()))
        out["skipped_total"] = sum(self.skipped.values())
        return out


def refuse_other_regeneration(
    folder: Path, manifest: Mapping[str, Any], keys: Sequence[str] = IDENTITY
) -> None:
    """Refuses (RegenerateMismatchError) a folder whose shard manifests differ from
    ``manifest`` in ``keys``."""
    for other in sorted(folder.glob("manifest-*.json")):
        diff = changed(json.loads(other.read_text(encoding="utf-8")), manifest, keys)
        if diff:
            raise RegenerateMismatchError(
                f"{folder} holds rows of another regeneration ({other.name}); changed: "
                + "; ".join(diff[:3])
                + ". Use another output_dir, or the same settings to resume"
            )


class ShardStore(AppendStore):
    """One shard's output files, locked, read back for resume; ``done``: the source indices
    already written or skipped."""

    def __init__(self, folder: Path, shard: int, num_shards: int) -> None:
        super().__init__()
        self.folder = folder
        self.shard, self.num_shards = shard, num_shards
        self.stem = f"shard-{shard:05d}-of-{num_shards:05d}"
        self.rows_path = folder / f"{self.stem}.jsonl"
        self.skipped_path = folder / f"{self.stem}.skipped.log"
        self.manifest_path = folder / f"manifest-{shard:05d}-of-{num_shards:05d}.json"
        self.done: set[int] = set()
        self.counts = Counts()
        self.manifest: dict[str, Any] = {}

    def open(self, manifest: dict[str, Any]) -> ShardStore:
        """Locks the shard (else RegenerateBusyError), refuses a folder of another
        regeneration (RegenerateMismatchError), reads back what is done."""
        self.lock(
            self.folder / f".{self.stem}.lock",
            lambda _: RegenerateBusyError(
                f"another process is writing {self.folder / self.stem}.jsonl; wait for it"
            ),
        )
        try:
            refuse_other_regeneration(self.folder, manifest)
        except RegenerateMismatchError:
            self.close()
            raise
        self.open_lines(self.rows_path, self.skipped_path)
        try:  # the complete lines written so far
            rows = read_json_lines(self.rows_path)
            skips = read_json_lines(self.skipped_path)
        except BadJsonLine as bad:
            raise RegenerateMismatchError(
                f"{bad.path}:{bad.number} is not a JSON line; remove that line or the file"
            ) from None
        done = [RowResult(int(r["regenerated"]["index"]), row=r) for r in rows]
        done += [RowResult(int(line["index"]), reason=str(line["reason"])) for line in skips]
        for result in done:
            if result.index not in self.done:
                self.done.add(result.index)
                self.counts.add(result)
        previous: dict[str, Any] = {}
        if self.manifest_path.is_file():
            previous = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        self.manifest = {**manifest, "sessions": previous.get("sessions", [])}
        self.write_manifest()
        return self

    def append(self, result: RowResult, row_id: str | None = None) -> None:
        """Appends one finished row (or its skip line) and flushes it to the OS."""
        if result.row is not None:
            self.write_line(self.rows_path, result.row, ensure_ascii=False)
        else:
            line = {"index": result.index, "id": row_id, "reason": result.reason}
            self.write_line(self.skipped_path, line)
        self.done.add(result.index)
        self.counts.add(result)

    def write_manifest(self, **extra: Any) -> dict[str, Any]:
        """Rewrites the manifest (atomically) with the current counts and ``extra`` fields."""
        self.manifest |= extra
        full = {**self.manifest, "counts": self.counts.as_dict(), "rows_file": self.rows_path.name}
        write_json(self.manifest_path, full)
        return full


def shard_indices(num_rows: int, shard: int, num_shards: int) -> list[int]:
    """The source indices of shard ``shard`` of ``num_shards``: ``index % num_shards == shard``."""
    return list(range(shard, num_rows, num_shards))


def read_folder(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every regenerated row of a folder's shards (complete lines), in source-index order."""
    rows = []
    for path in sorted(Path(folder).glob("shard-*.jsonl")):
        rows += [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1] if line]
    return sorted(rows, key=lambda r: int(r["regenerated"]["index"]))


def open_source(data: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The ``data.*`` fields' rows and the manifest's ``data`` entry (the fields, the
    source's fingerprint and name)."""
    from mtpc.data.sources import load_source

    source = load_source(
        str(data["source"]), data["path"], num_rows=data["num_rows"],
        seed=int(data["seed"] or 0), streaming=bool(data["streaming"]), revision=data["revision"],
        **({"hf_name": data["hf_name"]} if data["hf_name"] else {}),
    )  # fmt: skip
    return source, {**data, "fingerprint": source.fingerprint, "name": source.name}


def regenerate(cfg: Any) -> dict[str, Any]:
    """The whole job of ``scripts/regenerate.py``; returns the shard's manifest. Raises
    ConfigError (before anything loads) or RegenerateMismatchError."""
    import torch

    from mtpc.backbones.codecs import get_codec
    from mtpc.model import MTPCModel

    job = parse_regenerate(cfg)  # the one reading of cfg: below, the settings' named fields
    settings = job.decoder
    out = Path(job.output_dir).expanduser()
    if job.num_threads is not None:
        torch.set_num_threads(job.num_threads)
    source, data = open_source(job.data)
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION, "settings": settings.output_law(), "data": data,
        "num_shards": job.num_shards,
    }  # fmt: skip
    # settings, data and sharding are refused before the target loads; its weights after
    refuse_other_regeneration(out, manifest, [k for k in IDENTITY if k != "target"])
    backbone = load_target(job.model, job.device)
    if settings.draft is not None:  # refused when trained for another target
        model = MTPCModel.from_pretrained(settings.draft, target=backbone)
    else:
        model = MTPCModel.target_only(backbone)
    check_batch_size(job.batch_size, model.backbone, error=ConfigError)
    codec = get_codec(str(job.model.codec))
    manifest |= {
        "target": {"model": job.model.name, "path": job.model.path, "codec": codec.name,
                   "weights_fingerprint": model.backbone.weights_fingerprint()},
        "shard": job.shard,
        "decoder": asdict(settings),
    }  # fmt: skip
    with ShardStore(out, job.shard, job.num_shards).open(manifest) as store:
        resumed = len(store.done)
        rows, tokens, seconds = regenerate_shard(store, source, model, codec, job)
        session = {
            **provenance(str(job.device), Path(job.root_dir or ".")), "rows": rows,
            "resumed_after": resumed, "seconds": round(seconds, 3),
            "rows_per_second": round(rows / seconds, 4) if seconds > 0 else None,
            "new_tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else None,
            "method": settings.method, "batch_size": job.batch_size,
            "compile": settings.compile,
        }  # fmt: skip
        full = store.write_manifest(sessions=[*store.manifest["sessions"], session])
    print_summary(store, settings, rows, seconds)
    return full


def regenerate_shard(
    store: ShardStore, source: Any, model: Any, codec: ByteCodec, job: RegenerateSettings
) -> tuple[int, int, float]:
    """Regenerates the rows of ``store``'s shard it holds no line of, appending each as it
    finishes (``job.batch_size`` > 1: as each chunk of :data:`CHUNK_BATCHES` batches
    finishes); returns this session's (rows decoded, new tokens, seconds)."""
    import torch
    from tqdm.auto import tqdm

    from mtpc.decoding.common import context_length

    shard, num_shards, rows_total = store.shard, store.num_shards, source.num_rows
    total = None if rows_total is None else len(shard_indices(rows_total, shard, num_shards))
    bar = tqdm(
        total=total, initial=len(store.done), unit="row", desc=f"regenerate {store.stem}",
        dynamic_ncols=True, disable=not job.progress,
    )  # fmt: skip
    start, rows, tokens = time.perf_counter(), 0, 0
    size = 1 if job.batch_size == 1 else CHUNK_BATCHES * job.batch_size
    context = context_length(model)  # the target's (None: unbounded)
    todo = (
        (index, row)
        for index, row in enumerate(source)
        if index % num_shards == shard and index not in store.done
    )
    model.eval()
    with torch.inference_mode():
        # chunks of rows decoded together, written in source order
        while chunk := list(islice(todo, size)):
            results = regenerate_rows(model, codec, chunk, job.decoder, context, job.batch_size)
            for (_, row), result in zip(chunk, results, strict=True):
                row_id = row.get("id") if isinstance(row, Mapping) else None
                store.append(result, None if row_id is None else str(row_id))
                tokens += sum(result.row["regenerated"]["new_tokens"]) if result.row else 0
            rows += len(chunk)
            bar.update(len(chunk))
    bar.close()
    return rows, tokens, time.perf_counter() - start


def print_summary(store: ShardStore, settings: Settings, rows: int, seconds: float) -> None:
    """The shard's counts and this session's throughput, on stdout."""
    c = store.counts
    by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(c.skipped.items()))
    print(
        f"{store.rows_path}: {c.written} rows written, {sum(c.skipped.values())} skipped"
        + (f" ({by_reason})" if c.skipped else "")
        + f", {c.truncated_rows} truncated (a turn hit max_new_tokens={settings.max_new_tokens}); "
        f"this session {rows} rows in {seconds:.1f} s"
        + (f" ({rows / seconds:.2f} rows/s, {settings.method})" if seconds > 0 else "")
    )
    if c.not_byte_exact_turns or c.empty_turns:
        print(
            f"note: {c.not_byte_exact_turns} turns held special ids or invalid UTF-8 (written as "
            f"text), {c.empty_turns} turns are empty (train.py drops such rows)"
        )
