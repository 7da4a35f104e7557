"""The passes of ``eval.py drafter=hetero``: heterogeneous-vocabulary drafters against the
target alone (docs/HETERO.md, "Evaluator"). :func:`run_hetero_passes` is the one harness loop;
:func:`decode_hetero` runs it into an evaluation folder, :func:`evaluate_hetero` in memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtpc.backbones import Backbone
from mtpc.decoding import generate
from mtpc.decoding.common import GenerationResult
from mtpc.decoding.hetero import generate_hetero
from mtpc.decoding.vocab import as_tokenizer, prompt_overlap, vocab_mapping
from mtpc.evaluation.drafters import load_drafter
from mtpc.evaluation.loading import load_target
from mtpc.evaluation.metrics import hetero_metrics, hetero_record
from mtpc.evaluation.records import MemoryRecords, RecordStore, hetero_draft_path
from mtpc.evaluation.report import HETERO_PASSES, hetero_row_name, ratio
from mtpc.evaluation.settings import EvalSettings
from mtpc.model import MTPCModel

Decoder = Callable[[list[int], int], GenerationResult]
"""Decodes one prompt's target ids with a seed."""

AR_KEYWORDS = ("greedy", "max_new_tokens", "stop_ids", "temperature", "top_k", "top_p")


def hetero_decoders(
    target: Any, target_tokenizer: Any, drafter: Any, drafter_tokenizer: Any, **options: Any
) -> dict[str, Decoder]:
    """The AR and the heterogeneous speculative decoder of one prompt, by pass
    (``HETERO_PASSES``); ``options``: :func:`mtpc.generate_hetero`'s keywords, of which AR
    takes ``greedy``, ``max_new_tokens``, ``stop_ids`` (None: the target's) and the sampling
    ones (``target`` may also be a ``Backbone``: the AR pass keeps its attention path)."""
    t_tok, d_tok = as_tokenizer(target_tokenizer), as_tokenizer(drafter_tokenizer)
    stops = options.get("stop_ids")
    options["stop_ids"] = list(t_tok.stop_ids if stops is None else stops)
    ar_kw = {k: options[k] for k in AR_KEYWORDS if k in options}
    alone = MTPCModel.target_only(target)  # the one AR decoder: mtpc.generate's
    hf = target.hf_model if isinstance(target, Backbone) else target

    def run_ar(p: list[int], seed: int) -> GenerationResult:
        return generate(alone, p, method="autoregressive", seed=seed, **ar_kw)

    def run_sd(p: list[int], seed: int) -> GenerationResult:
        return generate_hetero(hf, t_tok, drafter, d_tok, p, seed=seed, **options)

    return dict(zip(HETERO_PASSES, (run_ar, run_sd), strict=True))


@dataclass(frozen=True)
class HeteroPrompt:
    """A prompt of :func:`run_hetero_passes` (``mtpc.data.prompts.EvalPrompt`` is one too)."""

    id: str
    prompt_ids: list[int]
    source: str | None = None


def run_hetero_passes(
    sink: MemoryRecords,
    decoders: Mapping[str, Decoder],
    prompt_sets: Sequence[Sequence[Any]],
    draft_path: str,
    name: str,
    seed: int,
    warmup: int,
) -> None:
    """Each pass decodes the prompts ``sink`` has no record of, after ``warmup`` untimed runs
    on the first prompt, and appends one record per prompt (:func:`hetero_record`) as it
    finishes. Set k, prompt i decodes with seed + k + i; ``name``: the hetero row's name."""
    for pass_name, decode in decoders.items():
        row_name = "AR (target)" if pass_name == HETERO_PASSES[0] else name
        todo = sink.pending(prompt_sets, draft_path, pass_name)
        for w in range(warmup if todo else 0):
            decode(list(prompt_sets[0][0].prompt_ids), seed + w)
        for k, i, p in todo:
            result = decode(list(p.prompt_ids), seed + k + i)
            sink.append(
                {"type": "prompt", "draft": row_name, "draft_path": draft_path, "pass": pass_name,
                 "set": k, "index": i, "prompt_id": p.id, "source": p.source, "seed": seed + k + i,
                 **hetero_record(result)}
            )  # fmt: skip


def overlap_stats(
    target_tokenizer: Any, drafter_tokenizer: Any, prompts: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """Vocabulary overlap (Timor et al., Table 5) and prompt-level overlap (Table 6)."""
    t_tok, d_tok = as_tokenizer(target_tokenizer), as_tokenizer(drafter_tokenizer)
    overlap = vocab_mapping(t_tok, d_tok).stats()
    overlap.update(prompt_overlap(t_tok, d_tok, [t_tok.decode_bytes(list(p)) for p in prompts]))
    return overlap


def evaluate_hetero(
    target: Any,
    target_tokenizer: Any,
    drafter: Any,
    drafter_tokenizer: Any,
    prompts: Sequence[str | Sequence[int]],
    algorithm: str = "slem",
    lookahead: int = 5,
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = 128,
    warmup: int = 1,
    stop_ids: Sequence[int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """AR vs heterogeneous speculative decoding of ``target`` on the same prompts (texts or
    target ids; prompt i uses seed + i for both); ``**options``: more
    :func:`mtpc.generate_hetero` keywords. The result: docs/HETERO.md, "Evaluator"."""
    t_tok = as_tokenizer(target_tokenizer)
    ids = [t_tok.prompt_ids(p) if isinstance(p, str) else list(p) for p in prompts]
    if not ids:
        raise ValueError("prompts is empty")
    decoders = hetero_decoders(
        target, target_tokenizer, drafter, drafter_tokenizer, greedy=greedy,
        max_new_tokens=max_new_tokens, stop_ids=stop_ids, algorithm=algorithm,
        lookahead=lookahead, **options,
    )  # fmt: skip
    sink = MemoryRecords()
    prompt_set = [HeteroPrompt(str(i), p) for i, p in enumerate(ids)]
    name = hetero_row_name(algorithm)
    run_hetero_passes(sink, decoders, [prompt_set], "drafter", name, seed, warmup)
    ar, sd = (hetero_metrics([r for r in sink.records if r["pass"] == p]) for p in HETERO_PASSES)
    sd["speedup_ar"] = ratio(sd["tok_s"], ar["tok_s"])
    return {
        "rows": [
            {"name": "AR (target)", "kind": "ar", **ar},
            {"name": name, "kind": algorithm, "lookahead": lookahead, **sd},
        ],
        "overlap": overlap_stats(target_tokenizer, drafter_tokenizer, ids),
        "settings": {
            "algorithm": algorithm, "lookahead": lookahead, "greedy": greedy, "seed": seed,
            "max_new_tokens": max_new_tokens, "num_prompts": len(ids), **options,
        },
    }  # fmt: skip


def decode_hetero(s: EvalSettings, store: RecordStore, prompt_sets: list[list[Any]]) -> None:
    """Decodes the prompts of ``drafter=hetero`` into ``store`` (resumable: prompts already
    recorded are skipped), then records the vocabulary overlap once (an ``overlap`` line)."""
    from mtpc.backbones.codecs import get_codec

    if s.drafter is None:
        raise ValueError("decode_hetero needs drafter=hetero")
    d, drafter = s.decoding, s.drafter
    device = str(s.run.device)
    backbone = load_target(s.model, device)
    codec = get_codec(str(s.model.codec))
    drafter_model = str(drafter.model)
    model, tokenizer = load_drafter(drafter_model, drafter.tokenizer, device=device)
    options = {k: getattr(drafter, k) for k in ("look_behind", "max_psi_paths", "psi")}
    if not d.greedy:
        options |= {k: getattr(d, k) for k in ("temperature", "top_k", "top_p")}
    algorithm = str(drafter.algorithm)
    decoders = hetero_decoders(
        backbone, codec, model, tokenizer, greedy=bool(d.greedy),
        max_new_tokens=int(d.max_new_tokens), algorithm=algorithm, lookahead=int(drafter.lookahead),
        **{k: v for k, v in options.items() if v is not None},
    )  # fmt: skip
    key = hetero_draft_path({"model": drafter_model})
    name, seed = hetero_row_name(algorithm), int(d.seed)
    run_hetero_passes(store, decoders, prompt_sets, key, name, seed, int(s.run.warmup))
    if not any(r.get("type") == "overlap" and r["draft_path"] == key for r in store.records):
        stats = overlap_stats(codec, tokenizer, [p.prompt_ids for p in prompt_sets[0]])
        store.append({"type": "overlap", "draft_path": key, **stats})
