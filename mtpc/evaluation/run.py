"""``evaluate(cfg)``: exported drafts against AR decoding of their target, on the same prompts;
each decoded prompt is appended to the folder's records, the tables built from them
(docs/EVALUATION.md)."""

from __future__ import annotations

import gc
import logging
import math
import resource
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mtpc.backbones import check_batch_size
from mtpc.backbones.codecs import get_codec
from mtpc.decoding import generate
from mtpc.decoding.common import cut_at_stop
from mtpc.evaluation.drafting import tree_budgets
from mtpc.evaluation.folders import build_manifest, check_prompts, eval_folder, fresh_folder
from mtpc.evaluation.hetero import decode_hetero
from mtpc.evaluation.loading import (
    load_for_eval,
    load_prompts,
    resolve_drafts,
    resolve_target,
    spec_bench_questions,
)
from mtpc.evaluation.metrics import pool_turns, prompt_record, tokens_sha1
from mtpc.evaluation.records import (
    MANIFEST,
    RecordStore,
    ar_turn_hashes,
    equal_turns,
    expand_folders,
    turn_hashes,
)
from mtpc.evaluation.report import build_report, report_folders
from mtpc.evaluation.settings import (
    CHUNK_BATCHES,
    EvalConfigError,
    EvalDecoding,
    EvalSettings,
    hydra_model_overrides,
    parse_eval,
)
from mtpc.export import read_config

logger = logging.getLogger(__name__)


def pass_kwargs(pass_name: str, d: EvalDecoding) -> dict[str, Any]:
    """The ``mtpc.generate`` keywords of a pass: ``ar``, ``speculative``, ``max_throughput``
    (accepting every draft) or ``tree<B>`` (a token tree of B nodes)."""
    kwargs = {
        "max_new_tokens": int(d.max_new_tokens), "greedy": bool(d.greedy), "policy": d.policy,
        "temperature": float(d.temperature), "top_k": d.top_k, "top_p": d.top_p,
        "suppress_eos": bool(d.suppress_eos),
    }  # fmt: skip
    if pass_name.startswith("tree"):  # a tree has no chain choice
        budget = int(pass_name.removeprefix("tree"))
        return {**kwargs, "tree_budget": budget, "tree_floor": float(d.tree_floor or 0.0)}
    if pass_name == "ar":
        return {**kwargs, "method": "autoregressive", "compile": d.compile}
    # the chains compile too; the token trees stay eager (docs/DECODING.md, "Compiled decoding")
    chain = {**kwargs, "draft": d.drafting, "proposal": d.proposal, "compile": d.compile}
    return {**chain, "max_throughput": True} if pass_name == "max_throughput" else chain


def warmup_prompts(
    model: Any, prompt_sets: Sequence[Sequence[Any]], max_new_tokens: int, window_prompt: bool
) -> list[list[int]]:
    """The prompts each pass decodes untimed before it is timed: the first prompt and, with
    ``window_prompt`` (``warmup_window``) on a target with an attention window W, one of 2W - h
    ids, h = max(1, min(max_new_tokens, W) // 2) (docs/EVALUATION.md, ``warmup_window``)."""
    prompts = [list(prompt_sets[0][0].prompt_ids)]
    window = getattr(model.backbone, "window_size", None)
    if not window_prompt or not window:
        return prompts
    new = int(max_new_tokens)
    length = 2 * int(window) - max(1, min(new, int(window)) // 2)
    context = getattr(model.backbone.config, "max_position_embeddings", None)
    if context and length + new + model.head.window > int(context):
        logger.info("warm-up: a prompt of %d ids does not fit the context %s", length, context)
        return prompts
    longest = max((list(p.prompt_ids) for s in prompt_sets for p in s), key=len)
    ids = longest * (length // len(longest) + 1)
    return [*prompts, ids[:length]]


class _Conversation:
    """One prompt on its way through its turns."""

    def __init__(self, prompt: Any) -> None:
        self.later = tuple(getattr(prompt, "later_turns", ()))
        self.ids = list(prompt.prompt_ids)
        self.messages = [dict(m) for m in prompt.messages]
        self.results: list[Any] = []
        self.lengths: list[int] = []

    def next_prompt(self, codec: Any, turn: int) -> list[int]:
        """The ids of turn ``turn`` (0: the prompt; later: after the model's last answer)."""
        if turn:  # the next user turn, after the model's own answer
            last = self.results[-1].tokens
            kept, _ = cut_at_stop(last, len(last), codec.stop_ids)
            self.messages += [
                {"role": "assistant", "content": codec.decode(kept)},
                {"role": "user", "content": self.later[turn - 1]},
            ]
            self.ids = codec.generation_prompt(self.messages)
        self.lengths.append(len(self.ids))
        return self.ids

    def record(self, per_cycle: bool, reference: Sequence[str] | None) -> dict[str, Any]:
        """The record's measurements (one turn's, or the turns' pooled and each turn's)."""
        results = self.results
        hashes = [tokens_sha1(r.tokens) for r in results]
        equal = None if reference is None else equal_turns(hashes, reference)
        rule = {"draft_rule": results[0].draft_rule} if per_cycle else {}
        if not self.later:  # one turn: the record of every single-turn evaluation
            return {
                "tokens_sha1": hashes[0], "equal_reference": None if equal is None else equal[0],
                **rule, **prompt_record(results[0], per_cycle=per_cycle),
            }  # fmt: skip
        full = [prompt_record(r, per_cycle=per_cycle) for r in results]
        turns = [  # each turn's scalars (its per-cycle lists are in the pooled record)
            {"tokens_sha1": h, "prompt_tokens": n,
             "equal_reference": None if equal is None else equal[j],
             **{key: v for key, v in rec.items() if not isinstance(v, list)}}
            for j, (h, n, rec) in enumerate(zip(hashes, self.lengths, full, strict=True))
        ]  # fmt: skip
        return {
            "tokens_sha1": tokens_sha1([t for r in results for t in r.tokens]),
            "equal_reference": None if equal is None else all(equal),
            **rule, **pool_turns(full), "turns": turns,
        }  # fmt: skip


class Lane:
    """One draft's decoding pass (or AR's: ``draft`` None, the draft's backbone is the target),
    decoded into the records by :func:`run_lanes`; ``path``, ``name``: the records'
    ``draft_path``, ``draft``."""

    def __init__(
        self, model: Any, s: EvalSettings, draft: Mapping[str, Any] | None, pass_name: str
    ) -> None:
        self.model = model
        self.settings = s
        self.pass_name = pass_name
        self.path = None if draft is None else draft["path"]
        self.name = "AR (target)" if draft is None else draft["name"]
        self.kwargs = pass_kwargs(pass_name, s.decoding)
        self.seed = int(s.decoding.seed)
        self.drafting = pass_name == "speculative" or pass_name.startswith("tree")
        self.check = self.drafting and bool(self.kwargs["greedy"])  # output == AR's
        self.batch_size = int(s.run.batch_size)
        check_batch_size(self.batch_size, model.backbone, error=EvalConfigError)
        self.codec = get_codec(model.backbone.codec)

    def warm_up(self, prompt_sets: Sequence[Sequence[Any]]) -> None:
        """``warmup`` untimed runs on each of :func:`warmup_prompts`, with this lane's method."""
        s = self.settings
        for w in range(int(s.run.warmup)):
            new, window = s.decoding.max_new_tokens, bool(s.run.warmup_window)
            for ids in warmup_prompts(self.model, prompt_sets, new, window):
                batch = [ids] * self.batch_size  # the timed runs' batch shape
                generate(self.model, batch, seed=self.seed + w, **self.kwargs)

    def decode(
        self, items: Sequence[tuple[int, int, Any]], references: Sequence[Sequence[str] | None]
    ) -> list[dict[str, Any]]:
        """The records of prompts ``items`` (set k, index i, the prompt), every turn of a
        multi-turn one after the model's own answer cut at its first stop id, pooled
        (docs/EVALUATION.md, "Records"); the k-th turns ``batch_size`` at once. A greedy
        drafting record without its reference (AR's ``tokens_sha1`` per turn; AR later on this
        prompt) is marked ``check_pending`` (``mtpc.evaluation.report.resolve_checks``)."""
        seeds = [self.seed + i + getattr(p, "seed_offset", 0) for _, i, p in items]
        pending = [self.check and ref is None for ref in references]
        checked = [None if not self.check or ref is None else ref for ref in references]
        convs = [_Conversation(p) for _, _, p in items]
        for turn in range(max(len(c.later) for c in convs) + 1):
            going = [c for c in convs if turn <= len(c.later)]
            ids = [c.next_prompt(self.codec, turn) for c in going]
            seed = [seeds[convs.index(c)] for c in going]
            size = min(self.batch_size, len(ids))
            out = generate(self.model, ids, seed=seed, batch_size=size, **self.kwargs)
            for c, result in zip(going, out, strict=True):
                c.results.append(result)
        fields = [c.record(self.drafting, ref) for c, ref in zip(convs, checked, strict=True)]
        return [
            {"type": "prompt", "draft": self.name, "draft_path": self.path,
             "pass": self.pass_name, "set": k, "index": i, "prompt_id": p.id,
             "source": p.source, "seed": s, **f,
             **({"check_pending": True} if wait else {})}
            for (k, i, p), s, f, wait in zip(items, seeds, fields, pending, strict=True)
        ]  # fmt: skip

    def close(self, store: RecordStore, peak_mb: float | None) -> None:
        """The ``pass`` record: every prompt of this lane is recorded."""
        record = {"type": "pass", "draft_path": self.path, "pass": self.pass_name}
        store.append({**record, "peak_memory_mb": peak_mb})


def cuda_index(device: str) -> int | None:
    """The CUDA device index of ``device`` (``cuda`` -> the current one); None for the CPU."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else int(index)


def sync_memory_reset(device: str) -> None:
    """Waits for ``device``'s work and restarts its peak-memory counter (CUDA only)."""
    index = cuda_index(device)
    if index is not None:
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)


def peak_memory_mb(device: str) -> float:
    """Peak memory in MiB: allocated on ``device``'s GPU since the last reset, or the
    process's peak RSS on the CPU (``ru_maxrss``: never reset)."""
    index = cuda_index(device)
    if index is not None:
        return torch.cuda.max_memory_allocated(index) / 2**20
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def interleaved_order(lanes: Sequence[Any], position: int) -> list[Any]:
    """The order of ``lanes`` on the prompt at ``position`` (counted over every set):
    as given on even positions, reversed on odd ones, so that each lane's mean position in
    time is the same and a drift of the machine's speed cancels in the ratios."""
    return list(lanes) if position % 2 == 0 else list(reversed(lanes))


def run_lanes(
    store: RecordStore, lanes: Sequence[Lane], prompt_sets: Sequence[Sequence[Any]], s: EvalSettings
) -> dict[Lane, int]:
    """Decodes the lanes' prompts ``store`` lacks, after the warm-up; returns the count per
    lane. ``interleave=false``: one lane, in order; ``true``: every lane prompt by prompt in
    :func:`interleaved_order` (a record's ``slot``), missing AR references left to the report
    (``check_pending``). ``pass`` records close the lanes, with the peak memory of them all."""
    from tqdm.auto import tqdm

    device, interleave = str(s.run.device), bool(s.run.interleave)
    todo = {lane: store.pending(prompt_sets, lane.path, lane.pass_name) for lane in lanes}
    busy = [lane for lane in lanes if todo[lane]]
    decoded = {lane: 0 for lane in lanes}
    if not busy:  # killed between the last prompt and the pass record
        for lane in lanes:
            lane.close(store, None)
        return decoded
    reference = ar_turn_hashes(store.records)
    sync_memory_reset(device)
    for lane in busy:
        lane.warm_up(prompt_sets)
    missing = {lane: {(k, i) for k, i, _ in todo[lane]} for lane in lanes}
    total = sum(len(p) for p in prompt_sets) * len(lanes)
    desc = "interleaved" if interleave else f"{lanes[0].name} [{lanes[0].pass_name}]"
    done = total - sum(len(t) for t in todo.values())
    bar = tqdm(  # on a terminal only (stderr)
        total=total, initial=done, desc=desc, unit="prompt", leave=False,
        dynamic_ncols=True, disable=None if s.run.progress else True,
    )  # fmt: skip
    every = [(k, i, p) for k, prompts in enumerate(prompt_sets) for i, p in enumerate(prompts)]
    order = every if interleave else todo[lanes[0]]
    # decoded together: batch_size 1: one prompt; B: CHUNK_BATCHES * B (finished rows refilled)
    size = 1 if lanes[0].batch_size == 1 else CHUNK_BATCHES * lanes[0].batch_size
    try:
        for position, start in enumerate(range(0, len(order), size)):
            chunk = order[start : start + size]
            for slot, lane in enumerate(interleaved_order(lanes, position)):
                mine = [(k, i, p) for k, i, p in chunk if (k, i) in missing[lane]]
                if not mine:
                    continue
                refs = [reference.get((k, i), None if interleave else []) for k, i, _ in mine]
                for (k, i, _), record in zip(mine, lane.decode(mine, refs), strict=True):
                    if interleave:
                        record["slot"] = slot  # its place among this prompt's lanes
                    store.append(record)
                    decoded[lane] += 1
                    bar.set_postfix_str(f"set {k + 1}/{len(prompt_sets)}", refresh=False)
                    bar.update()
                    if lane.pass_name == "ar":
                        reference[(k, i)] = turn_hashes(record)
    finally:
        bar.close()
    peak = peak_memory_mb(device)
    for lane in lanes:
        lane.close(store, peak)
    return decoded


def decode_all(
    s: EvalSettings, store: RecordStore, drafts: Sequence[Path], baselines: Sequence[Path]
) -> list[list[Any]] | None:
    """Decodes what ``store`` lacks: AR (with the first draft's target), then every draft,
    one after the other (``interleave=true``: all at once, prompt by prompt); returns the
    prompt sets when a model was loaded (None when every record was there)."""
    entries = store.manifest["drafts"]
    codec = read_config(Path(entries[0]["path"]))["codec"] if entries else str(s.model.codec)
    windows = [d["window"] for d in entries] or [0]
    new = int(s.decoding.max_new_tokens)
    passes = ["speculative"] + (["max_throughput"] if s.run.max_throughput else [])
    passes += [f"tree{b}" for b in tree_budgets(s.decoding.tree_budget)]
    finished = {(r["draft_path"], r["pass"]) for r in store.records if r.get("type") == "pass"}
    plan = []  # (index, path, entry, the passes it lacks)
    for index, (path, draft) in enumerate(zip([*drafts, *baselines], entries, strict=True)):
        wanted = (["ar"] if index == 0 else []) + passes
        todo = [p for p in wanted if (None if p == "ar" else draft["path"], p) not in finished]
        if not todo:
            logger.info(
                "[%d/%d] %s: already recorded in %s (resume=never measures it again in a new "
                "folder)", index + 1, len(entries), draft["name"], store.folder,
            )  # fmt: skip
        else:
            plan.append((index, path, draft, todo))
    prompt_sets: list[list[Any]] | None = None

    def prompts_for(model: Any) -> list[list[Any]]:
        nonlocal prompt_sets
        if prompt_sets is None:  # the target's context bounds the prompts
            context = getattr(model.backbone.config, "max_position_embeddings", None)
            limit = s.prompts.max_prompt_length
            if context:
                fit = int(context) - new - max(windows)
                limit = fit if limit is None else min(int(limit), fit)
            prompt_sets = load_prompts(s, codec, limit)
            check_prompts(store, prompt_sets)
        return prompt_sets

    for group in [plan] if s.run.interleave and plan else [[entry] for entry in plan]:
        decode_group(s, store, group, prompts_for)
        gc.collect()  # the group's models are gone before the next loads
    return prompt_sets


def decode_group(
    s: EvalSettings,
    store: RecordStore,
    group: Sequence[tuple[int, Path, Mapping[str, Any], list[str]]],
    prompts_for: Callable[[Any], list[list[Any]]],
) -> None:
    """Loads the drafts of ``group`` ((index, path, entry, the passes it lacks); one draft,
    or every draft with ``interleave=true``), decodes their passes and logs each draft's
    tokens per cycle and speed-up over AR (its chain row)."""
    start = time.perf_counter()
    models = {index: load_for_eval(path, s.model, str(s.run.device)) for index, path, _, _ in group}
    prompt_sets = prompts_for(next(iter(models.values())))
    lanes = [
        Lane(models[index], s, None if p == "ar" else draft, p)
        for index, _, draft, todo in group
        for p in todo
    ]
    counts: dict[Lane, int] = {}
    for batch in [lanes] if s.run.interleave else [[lane] for lane in lanes]:
        counts |= run_lanes(store, batch, prompt_sets, s)
    seconds = time.perf_counter() - start
    for index, _, draft, _ in group:
        decoded = sum(n for lane, n in counts.items() if lane.model is models[index])
        mine = [r for r in store.records if r.get("draft_path") in (None, draft["path"])]
        rows, _ = build_report({**store.manifest, "drafts": [draft]}, mine)
        row = next(r for r in rows if r["name"] == draft["name"])  # the chain, not a tree row
        logger.info(
            "[%d/%d] %s: %.2f tokens/cycle, %.2fx AR (%d prompts decoded in %.1f s)",
            index + 1, len(store.manifest["drafts"]), draft["name"], row.get("mu_acc", math.nan),
            row.get("speedup_ar", math.nan), decoded, seconds,
        )  # fmt: skip


def rebuild_report(s: EvalSettings) -> dict[str, Any]:
    """``report=<folder>`` (or a list, globs allowed): the report of the folders' records,
    merged, into ``output_dir`` (needed for several folders; else the folder itself)."""
    report = s.output.report
    folders = expand_folders([report] if isinstance(report, str) else report, s.output.root_dir)
    out = s.output.output_dir
    if out is None and len(folders) > 1:
        raise EvalConfigError(
            "report= with several folders needs output_dir=<where the merged report goes>"
        )
    result = report_folders(folders, Path(out) if out else folders[0], plots=bool(s.output.plots))
    print(f"results: {result['files']['json']}")
    return result


def evaluate(
    cfg: DictConfig | Mapping[str, Any], explicit_model: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluates the configured drafts (resuming their folder); prints the tables, writes results
    and returns ``report_folders``'s result plus ``folder``. The target is the drafts'; the
    ``model.*`` fields given (``explicit_model``; under Hydra the command line's) may not
    contradict it. EvalConfigError: a setting the evaluator refuses; RecordsError: the folder
    holds or is being written by another evaluation, or the report folders cannot be merged."""
    s = parse_eval(cfg)  # the one reading of cfg: below, the settings' named fields
    spec_bench_questions(s)  # prompts=spec_bench: a bad file is refused before anything loads
    if s.output.report:
        return rebuild_report(s)
    # drafter=hetero alone evaluates only the other-vocabulary drafter; with draft= both
    drafts = resolve_drafts(s.draft, s.output.root_dir) if s.drafter is None or s.draft else []
    base_paths = resolve_drafts(s.baseline, s.output.root_dir, key="baseline")
    baseline_set = {b.resolve() for b in base_paths}
    drafts = [d for d in drafts if d.resolve() not in baseline_set]  # also the baseline: once
    if drafts or base_paths:  # the target comes from the drafts
        explicit = hydra_model_overrides(cfg) if explicit_model is None else explicit_model
        s = replace(s, model=resolve_target(s.model, [*drafts, *base_paths], explicit))
    if s.run.num_threads:
        torch.set_num_threads(int(s.run.num_threads))
    index = cuda_index(str(s.run.device))
    if index is not None:  # cuda:<i>: kernels launched without a device and the counters on it
        torch.cuda.set_device(index)
    manifest = build_manifest(s, drafts, base_paths)
    folder = eval_folder(s, manifest)
    if s.output.resume == "never":
        folder = fresh_folder(folder)
    logger.info("evaluation folder: %s", folder)
    new = not (folder / MANIFEST).is_file()
    with RecordStore.open(folder, manifest, force=s.output.resume == "force") as store:
        try:
            prompt_sets = decode_all(s, store, drafts, base_paths)
            if s.drafter is not None:
                if prompt_sets is None:
                    prompt_sets = load_prompts(s, str(s.model.codec), s.prompts.max_prompt_length)
                    check_prompts(store, prompt_sets)
                decode_hetero(s, store, prompt_sets)
        except Exception:
            if new and not store.records:  # refused before any decoding: leave no folder
                shutil.rmtree(folder, ignore_errors=True)
            raise
    result = report_folders([folder], folder, plots=bool(s.output.plots))
    print(f"results: {result['files']['json']}")
    return {**result, "folder": str(folder)}
