"""Malformed rows counted by reason, seeded split, local formats, cache hits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import mtpc.data.cache as cache_module
from mtpc.backbones.codecs import get_codec
from mtpc.data.cache import load_prepared, prepare, summary_path
from mtpc.data.preprocess import DROP_REASONS, split_indices, tokenize_rows
from mtpc.data.sources import load_source, local_source


def good_row(i: int, source: str = "task/a") -> dict:
    return {
        "id": f"good-{i}",
        "messages": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ],
        "source": source,
    }


def write_malformed_jsonl(path: Path) -> dict[str, int]:
    """A JSONL file with good rows and every malformed kind; returns expected drop counts."""
    user = {"role": "user", "content": "q"}
    bad_rows = {
        "no_messages": [
            {"id": "a"},
            {"id": "b", "messages": []},
            {"id": "c", "messages": "hi"},
            [1, 2],
        ],
        "unknown_role": [
            {"id": "d", "messages": [{"role": "tool", "content": "x"}]},
            {"messages": ["str"]},
        ],
        "non_string_content": [
            {"id": "e", "messages": [user, {"role": "assistant", "content": 42}]},
            {"id": "f", "messages": [{"role": "user", "content": None}]},
        ],
        "empty_assistant_turn": [
            {"id": "g", "messages": [user, {"role": "assistant", "content": "  "}]}
        ],
        "no_assistant_turn": [{"id": "h", "messages": [user]}],
        "too_long": [{"id": "i", "messages": [user, {"role": "assistant", "content": "x" * 400}]}],
    }
    lines = [json.dumps(good_row(i)).encode() for i in range(6)]
    for rows in bad_rows.values():
        lines += [json.dumps(r).encode() for r in rows]
    # a lone surrogate survives json.loads but cannot be encoded as UTF-8
    lines.append(
        b'{"id": "j", "messages": [{"role": "user", "content": "\\ud800"}, '
        b'{"role": "assistant", "content": "ok"}]}'
    )
    lines.append(b'{"id": "k", "messages": [\xff\xfe]}')  # not UTF-8
    lines.append(b'{"id": "l", "messages": [')  # not JSON
    path.write_bytes(b"\n".join(lines) + b"\n")
    expected = dict.fromkeys(DROP_REASONS, 0)
    expected.update({k: len(v) for k, v in bad_rows.items()})
    expected["undecodable_text"] = 2
    expected["invalid_json"] = 1
    return expected


def test_every_malformed_kind_is_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = write_malformed_jsonl(tmp_path / "rows.jsonl")
    source = local_source(tmp_path / "rows.jsonl")
    with caplog.at_level(logging.WARNING):
        folder = prepare(source, "tiny", tmp_path / "cache", max_bytes=256, validation_fraction=0.2)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["dropped"] == expected
    assert summary["rows_used"] == 6
    assert summary["rows_seen"] == 6 + sum(expected.values())  # nothing silently lost
    assert summary["dropped_examples"]["too_long"] == ["i"]
    assert json.loads(summary_path(folder).read_text())["dropped"] == expected
    assert "dropped" in caplog.text and "too_long" in caplog.text


def test_zero_usable_rows_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x"}\n{"messages": [{"role": "user", "content": "q"}]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*no usable rows.*2 rows read.*no_messages"):
        prepare(local_source(path), "tiny", tmp_path / "cache")
    written = list((tmp_path / "cache" / "data").glob("*.summary.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["rows_seen"] == 2
    assert not [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]  # no half cache


def test_split_is_seeded_disjoint_and_complete() -> None:
    train, val = split_indices(1000, seed=3, validation_fraction=0.01)
    train2, val2 = split_indices(1000, seed=3, validation_fraction=0.01)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)
    assert len(val) == 10 and not set(train) & set(val)
    assert sorted([*train, *val]) == list(range(1000))
    _, other_val = split_indices(1000, seed=4, validation_fraction=0.01)
    assert not np.array_equal(val, other_val)
    assert len(split_indices(5, 0, 0.01)[1]) == 1  # at least one validation document


def test_tokenize_keeps_source_and_order() -> None:
    rows = [good_row(0, "b"), good_row(1, "a"), {"id": "x"}, {**good_row(2), "source": None}]
    docs, stats = tokenize_rows(rows, get_codec("llama3_byte"))
    assert docs.source_names == ["a", "b", "unknown"]
    assert docs.source_ids.tolist() == [1, 0, 2] and docs.row_positions.tolist() == [0, 1, 3]
    first = get_codec("llama3_byte").apply_chat_template(rows[0]["messages"])
    assert docs.ids[: docs.offsets[1]].tolist() == first.ids
    assert docs.assistant[: docs.offsets[1]].tolist() == first.assistant_mask
    assert stats.dropped["no_messages"] == 1


def test_cache_hit_does_not_tokenise_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [good_row(i) for i in range(50)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = prepare(local_source(path), "tiny", tmp_path / "cache", seed=1)
    stamp = (first / "ids.u16").stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenised again on a cache hit")

    monkeypatch.setattr(cache_module, "tokenize_rows", fail)
    assert prepare(local_source(path), "tiny", tmp_path / "cache", seed=1) == first
    assert (first / "ids.u16").stat().st_mtime_ns == stamp
    # a different codec, seed or context limit is a different cache entry
    with pytest.raises(AssertionError, match="tokenised again"):
        prepare(local_source(path), "llama3_byte", tmp_path / "cache", seed=1)
    with pytest.raises(AssertionError, match="tokenised again"):
        prepare(local_source(path), "tiny", tmp_path / "cache", seed=2)
    data = load_prepared(first)
    assert len(data.splits["train"]) + len(data.splits["val"]) == 50
    assert not set(data.splits["train"]) & set(data.splits["val"])
    val_ids = {r["id"] for r in data.val_rows()}
    assert val_ids == {f"good-{i}" for i in data.splits["val"].tolist()}


def test_local_formats_read_the_same_rows(tmp_path: Path) -> None:
    import datasets

    rows = [good_row(i, f"task/{i % 3}") for i in range(20)]
    ds = datasets.Dataset.from_list(rows)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for name in ["rows.jsonl", "rows.json", "rows.parquet", "saved", "saved_dict"]:
        source = load_source("tulu3", tmp_path / name)
        assert list(source) == rows, name
        assert source.take([5, 2]) == [rows[5], rows[2]], name
    limited = load_source("local", tmp_path / "rows.parquet", num_rows=7)
    assert [r["id"] for r in limited] == [f"good-{i}" for i in range(7)]
    with pytest.raises(ValueError, match=r"needs data\.path"):
        load_source("local")
    with pytest.raises(FileNotFoundError):
        load_source("tulu3", tmp_path / "missing.jsonl")


def test_hub_offline_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"allenai/tulu-3-sft-mixture.*data\.path="):
        load_source("tulu3")
