"""Spec-Bench prompts (Xia et al., 2024): ``question.jsonl`` read, checked and turned into
evaluation prompts, MT-bench's two-turn questions included (the format, the checks and the
multi-turn protocol: docs/EVALUATION.md, "Spec-Bench"). A :class:`SpecBenchPrompt` holds the
first turn with the generation prompt, and the later turns, each asked after the model's own
answer to the turn before (``mtpc.evaluation.run.Lane.decode``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mtpc.backbones.codecs import ByteCodec
from mtpc.data.prompts import EvalPrompt
from mtpc.errors import UserError

logger = logging.getLogger(__name__)

MT_BENCH_CATEGORIES = (  # Spec-Bench's "Multi-turn Conversation" task (``mt_bench``)
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)  # fmt: skip
MT_BENCH = "mt_bench"
OVERALL = "overall"


class SpecBenchError(UserError, ValueError):
    """A Spec-Bench file or selection that cannot be used; one line naming the file and line."""


@dataclass(frozen=True)
class Question:
    """One question of a Spec-Bench file."""

    id: str  # question_id as a string
    category: str
    turns: tuple[str, ...]  # the user turns, in order
    reference: str  # the first reference answer, or ""
    line: int  # 1-based line in the file


@dataclass(frozen=True)
class SpecBenchPrompt(EvalPrompt):
    """An evaluation prompt of a Spec-Bench question (``source`` is its category)."""

    later_turns: tuple[str, ...] = ()  # asked after the model's own answer to the one before
    seed_offset: int = 0  # added to the decoding seed: another run draws other samples


def _fail(path: Path, line: int, what: str) -> SpecBenchError:
    return SpecBenchError(
        f"{path}:{line}: {what}; a Spec-Bench line is a JSON object with question_id, "
        "category and turns (a list of non-empty strings)"
    )


def read_questions(path: str | Path) -> tuple[list[Question], str]:
    """Every question of a Spec-Bench ``question.jsonl``, checked, and the file's sha256;
    ``SpecBenchError`` for a missing or empty file, or a bad line (naming the file and line)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecBenchError(
            f"prompts.path={path} does not exist; allowed: a Spec-Bench question.jsonl "
            "(hemingkx/Spec-Bench, data/spec_bench/question.jsonl)"
        )
    data = path.read_bytes()
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as err:
            raise _fail(path, number, f"not JSON ({err.msg} at column {err.colno})") from None
        questions.append(_question(row, path, number, seen))
    if not questions:
        raise SpecBenchError(
            f"{path}: no questions (empty file); allowed: a Spec-Bench question.jsonl"
        )
    return questions, hashlib.sha256(data).hexdigest()


def _question(row: Any, path: Path, number: int, seen: dict[str, int]) -> Question:
    """One checked line (:func:`read_questions`)."""
    if not isinstance(row, dict):
        raise _fail(path, number, f"a JSON {type(row).__name__}, not an object")
    for field in ("question_id", "category", "turns"):
        if field not in row:
            raise _fail(path, number, f"no {field!r} field")
    qid = row["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, int | str) or qid == "":
        raise _fail(path, number, f"question_id={qid!r} is not an integer or a non-empty string")
    if str(qid) in seen:
        raise _fail(path, number, f"question_id={qid!r} repeats line {seen[str(qid)]}")
    seen[str(qid)] = number
    category = row["category"]
    if not isinstance(category, str) or not category.strip():
        raise _fail(path, number, f"category={category!r} is not a non-empty string")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise _fail(path, number, f"turns={turns!r} is not a non-empty list")
    for j, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise _fail(path, number, f"turns[{j}]={turn!r} is empty or not a string")
    reference = row.get("reference")
    first = reference[0] if isinstance(reference, list) and reference else reference
    return Question(
        str(qid), category, tuple(turns), first if isinstance(first, str) else "", number
    )


def select_questions(
    questions: Sequence[Question],
    path: str | Path,
    categories: Sequence[str] | None = None,
    turns: int | None = None,
) -> list[Question]:
    """The questions of ``categories`` (None: all) in file order, cut to ``turns`` turns;
    ``SpecBenchError`` for a category no question has (listing those the file has)."""
    if categories is not None:
        present = list(dict.fromkeys(q.category for q in questions))
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise SpecBenchError(
                f"prompts.categories={list(categories)}: no question of {path} has category "
                f"{', '.join(map(repr, unknown))}; allowed: {', '.join(present)}"
            )
        questions = [q for q in questions if q.category in categories]
    if turns is not None:
        questions = [replace(q, turns=q.turns[:turns]) for q in questions]
    return list(questions)


def conversation(question: Question, answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages before turn ``len(answers)``: each earlier user turn and its answer, then
    the user turn itself."""
    messages: list[dict[str, str]] = []
    for turn, answer in zip(question.turns, answers, strict=False):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": question.turns[len(answers)]}]


def longest_prompt(question: Question, codec: ByteCodec, max_new_tokens: int) -> int:
    """An upper bound on the ids of any turn's prompt: earlier answers count ``max_new_tokens``
    ids of at most 3 bytes each (U+FFFD for an invalid byte; valid UTF-8 never grows, special
    ids are dropped)."""
    worst = "\ufffd" * max_new_tokens
    last = len(question.turns) - 1
    return len(codec.generation_prompt(conversation(question, [worst] * last)))


def build_prompt_sets(
    questions: Sequence[Question],
    codec: ByteCodec,
    num_sets: int = 1,
    max_new_tokens: int = 1024,
    max_prompt_length: int | None = None,
    per_category: int | None = None,
    num_prompts: int | None = None,
    path: str | Path = "prompts.path",
) -> list[list[SpecBenchPrompt]]:
    """``num_sets`` runs over the same questions (Spec-Bench repeats its runs), in file order. A
    question whose last turn's prompt could exceed ``max_prompt_length`` is left out with a warning;
    then ``per_category`` and ``num_prompts`` keep the first questions. ``SpecBenchError`` when
    ``num_prompts`` exceeds the questions that fit, or none fits."""
    fit = [
        q
        for q in questions
        if max_prompt_length is None
        or longest_prompt(q, codec, max_new_tokens) <= max_prompt_length
    ]
    if len(fit) < len(questions):
        left = [q.id for q in questions if q not in fit]
        logger.warning(
            "prompts=spec_bench: %d of %d questions left out, a turn's prompt could exceed "
            "%s ids (the target's context - max_new_tokens - window, or max_prompt_length): "
            "question_id %s",
            len(left), len(questions), max_prompt_length, ", ".join(left),
        )  # fmt: skip
    if not fit:
        raise SpecBenchError(
            f"{path}: no question fits a prompt of {max_prompt_length} ids with "
            f"max_new_tokens={max_new_tokens}; lower max_new_tokens"
        )
    if per_category is not None:
        count: dict[str, int] = {}
        chosen = []
        for q in fit:
            count[q.category] = count.get(q.category, 0) + 1
            if count[q.category] <= per_category:
                chosen.append(q)
        fit = chosen
    if num_prompts is not None:
        if num_prompts > len(fit):
            raise SpecBenchError(
                f"num_prompts={num_prompts}: {path} has {len(fit)} questions that fit the "
                f"selection; allowed: an integer in 1..{len(fit)} or null (all)"
            )
        fit = fit[:num_prompts]

    def prompt(q: Question, run: int) -> SpecBenchPrompt:
        messages = conversation(q, [])
        ids = codec.generation_prompt(messages)
        return SpecBenchPrompt(
            q.id, q.category, messages, ids, q.reference,
            later_turns=q.turns[1:], seed_offset=run * len(fit),
        )  # fmt: skip

    return [[prompt(q, run) for q in fit] for run in range(num_sets)]
