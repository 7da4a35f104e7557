"""The benchmark harness (scripts/benchlib.py): what its timers call and what its reports print."""

from __future__ import annotations

import importlib.util
import json
import mmap
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "benchlib", Path(__file__).resolve().parents[1] / "scripts" / "benchlib.py"
)
assert _spec is not None and _spec.loader is not None
benchlib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(benchlib)
markdown_header, markdown_row, median_time = (
    benchlib.markdown_header,
    benchlib.markdown_row,
    benchlib.median_time,
)
peak_rss_extra_mb, timed, write_json = (
    benchlib.peak_rss_extra_mb,
    benchlib.timed,
    benchlib.write_json,
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

    held: list[mmap.mmap] = []

    def allocate() -> None:
        # fresh anonymous pages, each touched: a bytearray may reuse heap pages that earlier
        # tests freed and that are still resident (seen in CI: 0.0 with the block held)
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        held.append(block)

    # the block is still held when VmHWM is read: a block freed inside the call is seen only
    # once the kernel folds its RSS into the high-water mark, which it may do lazily
    assert peak_rss_extra_mb(allocate) >= 0.9 * size / 2**20
    for block in held:
        block.close()
    held.clear()
    assert peak_rss_extra_mb(lambda: None) < 0.5 * size / 2**20


def test_bench_batch_reports_every_size_and_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/bench_batch.py on 2 short prompts, B = 1 and 2, the pretrained-init draft:
    one row per (mode, B), the speed-ups relative to B = 1, and greedy output that does not
    depend on B (nor on the method)."""
    import torch

    import mtpc

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_batch
    finally:
        sys.path.pop(0)
    codec = mtpc.get_codec("tiny")
    texts = ("Reverse the word Hello.", "Count to three.")
    prompts = [codec.generation_prompt([{"role": "user", "content": t}]) for t in texts]
    monkeypatch.setattr(bench_batch, "_prompts", lambda count, codec, max_len: prompts[:count])
    out = tmp_path / "rows.json"
    argv = ["--prompts", "2", "--sizes", "1", "2", "--max-new-tokens", "4", "--sampling",
            "--what", "decode", "regenerate"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        report = bench_batch.main([*argv, "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # main sets 1 thread, as the benchmarks run
    rows = report["decode"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [
        ("greedy", 1), ("greedy", 2), ("sampling", 1), ("sampling", 2)
    ]  # fmt: skip
    for r in rows:
        assert r["new_tokens"] == 2 * 4  # end of turn suppressed: every row its 4 tokens
        assert r["sd_x_ar"] == pytest.approx(r["sd_tok_s"] / r["ar_tok_s"])
        assert r["tok_per_cycle"] >= 1.0 and r["tok_per_cycle_pooled"] >= 1.0
        assert r["ar_differ_first"] == r["sd_differ_first"] == 0  # seeded per row: B-free
        assert sum(r["sd_shares"].values()) == pytest.approx(1.0)
    assert rows[0]["ar_x_first"] == rows[0]["sd_x_first"] == 1.0
    assert rows[0]["sd_differ_ar"] == rows[1]["sd_differ_ar"] == 0  # greedy SD is AR's
    assert rows[0]["tok_per_cycle"] == rows[1]["tok_per_cycle"]
    assert json.loads(out.read_text())["decode"][3]["batch_size"] == 2
    regen = report["regenerate"]
    assert [r["batch_size"] for r in regen] == [1, 2] and regen[0]["x_first"] == 1.0
    assert all(r["rows"] == 2 and r["rows_s"] > 0 and r["differ_first"] == 0 for r in regen)
    table = capsys.readouterr().out
    assert "| greedy | 2 |" in table and "pretrained MTP init" in table
