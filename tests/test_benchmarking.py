"""The benchmark harness (mtpc/benchmarking.py): what its timers call and what its reports print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mtpc.benchmarking import (
    markdown_header,
    markdown_row,
    median_time,
    peak_rss_extra_mb,
    timed,
    write_json,
)


def test_timers_call_as_told_and_return_the_result() -> None:
    calls: list[int] = []

    def fn() -> int:
        calls.append(1)
        return len(calls)

    seconds, result = median_time(fn, repeats=3, warmup=2)
    assert len(calls) == 5 and result == 5 and seconds >= 0.0  # 2 warm-ups + 3 timed
    seconds, result = timed(fn)
    assert result == 6 and seconds >= 0.0


def test_reports_are_markdown_tables_and_json(tmp_path: Path) -> None:
    assert markdown_header("a", "b") == "| a | b |\n|---|---|"
    assert markdown_row(["x", 1, f"{0.5:.2f}", ""]) == "| x | 1 | 0.50 | |"
    write_json(tmp_path / "rows.json", [{"a": 1}])
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}]
    write_json(None, [1])  # no path: nothing written, no error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM / clear_refs: Linux")
def test_peak_rss_extra_sees_what_a_call_allocates() -> None:
    size = 64 * 2**20

    def allocate() -> None:
        block = bytearray(size)  # touched: zero-filled pages are resident
        del block

    assert peak_rss_extra_mb(allocate) >= 0.9 * size / 2**20
    assert peak_rss_extra_mb(lambda: None) < 0.5 * size / 2**20
