"""The shared file machinery: one stale-temp cleaner and one folder lock (mtpc/files.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpc.files import (
    BadJsonLine,
    FolderBusy,
    FolderLock,
    read_json_lines,
    remove_stale_tmp,
    tmp_writer_pid,
    trim_torn_line,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_tmp_writer_pid_both_spellings() -> None:
    assert tmp_writer_pid(".last.ckpt.tmp-123") == 123
    assert tmp_writer_pid(".abc.456.tmp") == 456
    assert tmp_writer_pid(".abc.tmp") is None


def test_remove_stale_tmp_keeps_live_writers(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    stale = [tmp_path / f".a.ckpt.tmp-{dead}", tmp_path / f".prep.{dead}.tmp", tmp_path / ".x.tmp"]
    kept = [tmp_path / f".b.ckpt.tmp-{live}", tmp_path / f".prep.{live}.tmp", tmp_path / "data"]
    for path in stale + kept:
        if path.name.endswith(".tmp"):
            path.mkdir()
            (path / "part").write_text("x")
        else:
            path.write_text("x")
    removed = remove_stale_tmp(tmp_path)
    assert sorted(removed) == sorted(stale)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in stale)
    assert remove_stale_tmp(tmp_path / "missing") == []


def test_folder_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    path = tmp_path / ".lock"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from mtpc.files import FolderLock; "
            f"FolderLock(Path({str(path)!r})).acquire(); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy) as err:
            FolderLock(path).acquire()
        assert f"pid {child.pid}" in err.value.holder
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    with FolderLock(path) as lock:  # released when its holder ended
        assert f"pid {os.getpid()}" in lock.path.read_text()
    FolderLock(path, enabled=False).acquire()  # a disabled lock never blocks


def test_json_lines_after_a_kill(tmp_path: Path) -> None:
    """The line in flight at a kill is left out (read) or cut off (trim); a damaged complete
    line is refused with its number."""
    path = tmp_path / "rows.jsonl"
    assert read_json_lines(path) == []
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_json_lines(path) == [{"a": 1}, {"a": 2}]
    trim_torn_line(path)
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    trim_torn_line(path)  # nothing torn: unchanged
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    path.write_bytes(b'{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(BadJsonLine) as bad:
        read_json_lines(path)
    assert bad.value.number == 2
