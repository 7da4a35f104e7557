"""Synthetic chat data: determinism, schema, coverage, multi-answer balance, splits, cache."""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from mtpc.backbones.codecs import get_codec
from mtpc.data import synthetic
from mtpc.data.synthetic import (
    FAMILIES,
    MULTI_ANSWER_QUESTIONS,
    default_cache_dir,
    generate_rows,
    load_synthetic,
    read_jsonl,
    write_jsonl,
)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return generate_rows(6000, seed=0)


def test_deterministic_and_prefix_stable(rows: list[dict]) -> None:
    assert generate_rows(300, seed=0) == rows[:300]
    assert generate_rows(300, seed=0) == generate_rows(300, seed=0)


def test_seeds_differ() -> None:
    a, b = generate_rows(200, seed=0), generate_rows(200, seed=1)
    assert sum(x["messages"] != y["messages"] for x, y in zip(a, b, strict=True)) > 100
    assert {r["id"] for r in a}.isdisjoint(r["id"] for r in b)


def test_schema(rows: list[dict]) -> None:
    codec = get_codec("evabyte")
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert set(row) == {"id", "messages", "source"}
        assert isinstance(row["id"], str)
        assert row["source"].removeprefix("synthetic/") in FAMILIES
        messages = row["messages"]
        if messages[0]["role"] == "system":
            messages = messages[1:]
        assert len(messages) in (2, 4)
        for i, message in enumerate(messages):
            assert set(message) == {"role", "content"}
            assert message["role"] == ("user", "assistant")[i % 2]
            assert isinstance(message["content"], str) and message["content"]
        codec.apply_chat_template(row["messages"])  # renders without error


def test_every_family_and_system_prompts_present(rows: list[dict]) -> None:
    sources = Counter(r["source"] for r in rows)
    assert set(sources) == {f"synthetic/{f}" for f in FAMILIES}
    assert min(sources.values()) > 0.05 * len(rows)
    with_system = sum(r["messages"][0]["role"] == "system" for r in rows)
    assert 0.08 * len(rows) < with_system < 0.25 * len(rows)
    multi_turn = [r for r in rows if r["source"] == "synthetic/multi_turn"]
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) == 2 for r in multi_turn)


def test_answers_are_short(rows: list[dict]) -> None:
    lengths = [
        len(m["content"].encode()) for r in rows for m in r["messages"] if m["role"] == "assistant"
    ]
    assert max(lengths) <= 80
    assert sum(1 <= n <= 60 for n in lengths) / len(lengths) > 0.95


def test_answers_are_correct(rows: list[dict]) -> None:
    for row in rows:
        if row["source"] != "synthetic/arithmetic":
            continue
        answer = row["messages"][-1]["content"]
        expression, result = answer.rstrip(".").split(" = ")
        assert eval(expression) == int(result)  # only digits and + - * from the generator


def test_multi_answer_uniform(rows: list[dict]) -> None:
    valid = dict(MULTI_ANSWER_QUESTIONS)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for row in rows:
        if row["source"] == "synthetic/multi_answer":
            question, answer = row["messages"][-2]["content"], row["messages"][-1]["content"]
            assert answer in valid[question]
            counts[question][answer] += 1
    assert set(counts) == set(valid)
    for question, answers in valid.items():
        total = sum(counts[question].values())
        expected = total / len(answers)
        for answer in answers:
            # multinomial counts stay within 4 standard deviations of uniform
            assert abs(counts[question][answer] - expected) < 4 * expected**0.5, (question, answer)


def test_multi_answers_differ_in_several_bytes() -> None:
    for question, answers in MULTI_ANSWER_QUESTIONS:
        assert len(answers) >= 2
        for a, b in itertools.combinations(answers, 2):
            x, y = a.encode(), b.encode()
            differing = sum(p != q for p, q in itertools.zip_longest(x, y))
            assert differing >= 3, (question, a, b)


def test_split_disjoint_and_complete(tmp_path: Path) -> None:
    data = load_synthetic(tmp_path, num_rows=2000, seed=3, validation_fraction=0.1)
    train, val = set(data["train"]["id"]), set(data["validation"]["id"])
    assert train.isdisjoint(val)
    assert train | val == {r["id"] for r in generate_rows(2000, seed=3)}
    assert 120 < len(val) < 280
    # a row's split does not depend on the dataset size
    small = load_synthetic(tmp_path, num_rows=500, seed=3, validation_fraction=0.1)
    assert set(small["validation"]["id"]) == {i for i in val if int(i.rsplit("-", 1)[1]) < 500}
    assert data["train"][0]["messages"][0]["role"] in ("system", "user")


def test_cache_written_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_synthetic(tmp_path, num_rows=300, seed=1)
    files = sorted(tmp_path.rglob("*.jsonl"))
    assert [f.name for f in files] == ["train.jsonl", "validation.jsonl"]
    mtimes = [f.stat().st_mtime_ns for f in files]

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("regenerated although the cache exists")

    monkeypatch.setattr(synthetic, "generate_rows", fail)
    second = load_synthetic(tmp_path, num_rows=300, seed=1)
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    for split in ("train", "validation"):
        assert first[split].to_list() == second[split].to_list()
    assert sum(f.stat().st_size for f in files) < 100_000


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MTPC_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("MTPC_CACHE")
    repo = Path(synthetic.__file__).resolve().parents[2]
    assert default_cache_dir() == repo / ".cache" / "mtpc"


def test_jsonl_round_trip(tmp_path: Path) -> None:
    rows = generate_rows(20, seed=0)
    path = tmp_path / "sub" / "rows.jsonl"
    write_jsonl(rows, path)
    assert read_jsonl(path) == rows
    assert json.loads(path.read_text(encoding="utf-8").splitlines()[0]) == rows[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_rows": -1}, "num_rows"), ({"validation_fraction": 1.5}, "validation_fraction")],
)
def test_bad_arguments_name_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        load_synthetic(tmp_path, **kwargs)
    if field == "num_rows":
        with pytest.raises(ValueError, match=field):
            generate_rows(-1)
