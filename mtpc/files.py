"""File machinery shared by training, data, evaluation and regeneration (torch-free): folder
locks, stale temporary files, JSON-lines files after a kill. Every temporary name carries its
writer's pid: ``.<name>.tmp-<pid>`` (checkpoints, exports) or ``.<name>.<pid>.tmp`` (data)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TMP_PID = re.compile(r"\.tmp-(\d+)$|\.(\d+)\.tmp$")  # the writer's pid in a temporary name


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (this process counts as running)."""
    try:
        os.kill(pid, 0)  # signal 0: checks only
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def tmp_writer_pid(name: str) -> int | None:
    """The pid in a temporary file name (see the module docstring), or None."""
    match = _TMP_PID.search(name)
    return None if match is None else int(match.group(1) or match.group(2))


def write_text_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: a temporary file named with this process's pid
    (the form :func:`remove_stale_tmp` clears when its writer is gone), then a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def remove_stale_tmp(folder: Path, what: str = "an interrupted write") -> list[Path]:
    """Removes and returns ``folder``'s hidden temporary entries (``.*.tmp*``) whose writer is
    gone; ``what`` left them (for the log line). An entry whose name carries no pid cannot
    belong to a running writer of this project and is removed too."""
    removed = []
    for tmp in sorted(folder.glob(".*.tmp*")):  # none in a missing folder
        pid = tmp_writer_pid(tmp.name)
        if pid is not None and pid_alive(pid):
            continue
        log.warning("removing %s, left by %s", tmp, what)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


class FolderBusy(Exception):
    """Another process holds the lock; ``holder`` is what it wrote in the lock file."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


class FolderLock:
    """An exclusive, non-blocking ``flock`` on ``path`` (created when missing), held until
    :meth:`release` or the process ends, however it ends (no stale locks); the file names the
    last holder (pid, host, start time) for a refusal. ``enabled=False``: a no-op lock (e.g. off
    global rank 0); on a file system without locks it warns and the caller runs unlocked."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock and records this process as its holder; :class:`FolderBusy` when
        another process holds it."""
        if not self.enabled or self._fd is not None:
            return
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)  # a file system without locks: run unlocked, but say so
                log.warning("cannot lock %s (%s); running without a lock", self.path, err)
                return
            holder = self.path.read_text(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise FolderBusy(self.path, holder) from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%dT%H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Releases the lock (the file stays; it only records the last holder)."""
        if self._fd is None:
            return
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BadJsonLine(ValueError):
    """A complete line of a JSON-lines file does not parse (the file is damaged)."""

    def __init__(self, path: Path, number: int) -> None:
        super().__init__(f"{path}:{number}")
        self.path, self.number = path, number


def trim_torn_line(path: Path) -> None:
    """Cuts ``path`` after its last newline: a line a kill left half written goes."""
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)


def read_json_lines(path: Path) -> list[Any]:
    """The JSON values of ``path``, one per line ([] when it does not exist). A last line
    without its newline that does not parse (in flight at a kill) is left out; any other
    raises :class:`BadJsonLine`."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if number == len(lines):  # no newline after it
                continue
            raise BadJsonLine(path, number) from None
    return out
