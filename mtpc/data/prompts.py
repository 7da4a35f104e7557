"""Evaluation prompt sets from the validation split (paper Sec. 4.2 and App. F).

See docs/DATA.md, "Evaluation prompts". The English filter is a heuristic: the letter test
(95 % ASCII) rejects non-Latin scripts and accented text; the function-word test (3 % of
the words, prompts of 10+ words) rejects most French / Spanish / German prompts. Answers
face the letter test only, as code has no function words. Expect a few misses both ways.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mtpc.backbones.codecs import ByteCodec
from mtpc.data.preprocess import check_row

logger = logging.getLogger(__name__)

PROMPT_SET_SEEDS = (0, 1, 2)  # paper App. F: three runs with different prompts
DEFAULT_NUM_PROMPTS = 250

ENGLISH_STOPWORDS = frozenset(
    (
        "a", "an", "the", "and", "or", "but", "if", "of", "to", "in", "on", "at", "for", "with",
        "from", "by", "about", "as", "is", "are", "was", "were", "be", "been", "do", "does", "did",
        "can", "could", "would", "should", "will", "shall", "may", "might", "must", "have", "has",
        "had", "not", "no", "this", "that", "these", "those", "it", "its", "i", "you", "he", "she",
        "we", "they", "me", "my", "your", "our", "their", "what", "which", "who", "whom", "how",
        "why", "when", "where", "please", "write", "give", "explain", "there", "here", "than",
        "then", "so",
    )
)  # fmt: skip
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt; ``reference`` is the answer to the last user turn."""

    id: str
    source: str
    messages: list[dict[str, str]]  # up to and including the last user turn
    prompt_ids: list[int]  # messages with the generation prompt (assistant header)
    reference: str


def ascii_letter_ratio(text: str) -> float:
    """Share of letters that are ASCII a-z / A-Z (1.0 for a text without letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isascii() for c in letters) / len(letters) if letters else 1.0


def stopword_ratio(text: str) -> float:
    """Share of (ASCII) words that are English function words."""
    words = _WORD.findall(text.lower())
    return sum(w in ENGLISH_STOPWORDS for w in words) / len(words) if words else 0.0


def is_english(prompt: str, reference: str = "") -> bool:
    """The English heuristic of the module docstring on a prompt and its reference."""
    if min(ascii_letter_ratio(prompt), ascii_letter_ratio(reference)) < 0.95:
        return False
    return len(_WORD.findall(prompt)) < 10 or stopword_ratio(prompt) >= 0.03


def split_at_last_user(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, str]], str] | None:
    """(conversation up to the last user turn, the assistant turns after it joined), or None."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return None
    answers = [str(m["content"]) for m in messages[last_user + 1 :] if m.get("role") == "assistant"]
    if not answers:
        return None
    prompt = [
        {"role": str(m["role"]), "content": str(m["content"])} for m in messages[: last_user + 1]
    ]
    return prompt, "\n".join(answers)


class UnknownSourceError(ValueError):
    """``sources`` names a source that no usable prompt has; the message lists the available."""


def build_prompt_sets(
    rows: Iterable[Mapping[str, Any]],
    codec: ByteCodec,
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    seeds: Sequence[int] = PROMPT_SET_SEEDS,
    english_only: bool = True,
    max_prompt_length: int | None = None,
    sources: Sequence[str] | None = None,
) -> list[list[EvalPrompt]]:
    """One prompt set per seed, drawn from the validation rows.

    Set k is a seeded sample (``seeds[k]``) from the pool the sets before it left, so sets
    are disjoint while the pool allows; a smaller pool gives overlapping sets (with a
    warning), or all of it in a seeded order. ``sources`` keeps those ``source`` values; one
    that no usable prompt has raises ``UnknownSourceError``.
    """
    rows = list(rows)
    pool: list[EvalPrompt] = []  # every usable prompt, in row order (malformed rows skipped)
    for position, row in enumerate(rows):
        parts = split_at_last_user(row["messages"]) if check_row(row) is None else None
        if parts is None:
            continue
        messages, reference = parts
        user_text = "\n".join(m["content"] for m in messages if m["role"] == "user")
        if english_only and not is_english(user_text, reference):
            continue
        ids = codec.generation_prompt(messages)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            continue
        row_id = str(row.get("id") or f"row-{position}")
        pool.append(
            EvalPrompt(row_id, str(row.get("source") or "unknown"), messages, ids, reference)
        )
    skipped = len(rows) - len(pool)
    logger.info(
        "prompt pool: %d usable, %d skipped (english_only=%s)", len(pool), skipped, english_only
    )
    if sources is not None:
        names = sorted({p.source for p in pool})
        unknown = [s for s in sources if s not in names]
        if unknown:
            raise UnknownSourceError(
                f"sources={list(sources)}: no evaluation prompt has source "
                f"{', '.join(map(repr, unknown))}; available: {', '.join(names)}"
            )
        pool = [p for p in pool if p.source in set(sources)]
    disjoint = len(pool) >= num_prompts * len(seeds)
    if not disjoint:
        logger.warning(
            "only %d prompts for %d sets of %d: sets overlap", len(pool), len(seeds), num_prompts
        )
    available = np.arange(len(pool))
    sets: list[list[EvalPrompt]] = []
    for seed in seeds:  # available: the whole pool when the sets overlap
        picked = np.random.default_rng(seed).permutation(available)[:num_prompts]
        sets.append([pool[i] for i in picked.tolist()])
        if disjoint:
            available = np.setdiff1d(available, picked)
    return sets
