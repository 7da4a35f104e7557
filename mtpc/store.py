"""Append-only record folders, shared by the evaluation (``mtpc.evaluation.records``) and
regeneration (``mtpc.regeneration``): strict JSON (NaN -> null, atomic writes),
manifest differences, provenance, and :class:`AppendStore`, a locked folder of JSON-lines files
flushed line by line (a kill loses at most the line in flight, dropped at the next open)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self

from mtpc.files import FolderBusy, FolderLock, trim_torn_line, write_text_atomic


def strict_json(value: Any) -> Any:
    """``value`` with every NaN / inf float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    if isinstance(value, str | int | bool) or value is None:
        return value
    return str(value)


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text (NaN -> null, non-JSON objects -> their ``str``)."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


def write_json(path: Path, value: Any) -> None:
    """Writes strict, indented JSON atomically (temporary file + rename)."""
    write_text_atomic(path, dumps(value, indent=2) + "\n")


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two JSON-like values, one per changed field."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    if prefix == "drafts" and isinstance(old, list) and isinstance(new, list):
        before = {d["path"]: d for d in old}
        after = {d["path"]: d for d in new}
        out = [f"drafts: {p} removed" for p in before if p not in after]
        out += [f"drafts: {p} added" for p in after if p not in before]
        for p in before.keys() & after.keys():
            out += differences(before[p], after[p], f"drafts[{p}]")
        return out
    return [] if strict_json(old) == strict_json(new) else [f"{prefix}: {old!r} -> {new!r}"]


def changed(old: Mapping[str, Any], new: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """:func:`differences` of two manifests' identity fields ``keys``."""
    return differences({k: old.get(k) for k in keys}, {k: new.get(k) for k in keys})


def device_name(device: str) -> str:
    """The accelerator's name for ``cuda*``, else the CPU model."""
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path) -> str | None:
    """The project's git commit (``+dirty`` with local changes), or None outside a checkout."""

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return run.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def provenance(device: str, root: Path) -> dict[str, Any]:
    """Where and with what a measurement ran: device, versions, commit, threads, date."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    try:
        mtpc_version: str | None = version("mtpc")
    except PackageNotFoundError:
        mtpc_version = None
    return {
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "mtpc": mtpc_version,
        "python": platform.python_version(),
        "git_commit": git_commit(root),
        "num_threads": torch.get_num_threads(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


class AppendStore:
    """A folder written by one process at a time, through append-only JSON-lines files; its
    users keep a manifest beside them whose identity fields must agree to resume."""

    def __init__(self) -> None:
        self._lock: FolderLock | None = None
        self._lines: dict[Path, IO[str]] = {}

    def lock(self, path: Path, busy: Callable[[FolderBusy], Exception]) -> None:
        """Creates the folder of lock file ``path`` and takes the lock; raises
        ``busy(FolderBusy)`` when another process holds it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(path)
        try:
            lock.acquire()
        except FolderBusy as held:
            raise busy(held) from None
        self._lock = lock

    def open_lines(self, *paths: Path) -> None:
        """Opens the JSON-lines files ``paths`` for appending, each cut after its last newline."""
        for path in paths:
            trim_torn_line(path)
            self._lines[path] = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write_line(self, path: Path, value: Any, ensure_ascii: bool = True) -> None:
        """Appends ``value`` as one compact strict-JSON line to ``path`` and flushes it to the
        OS (it survives a kill of this process)."""
        file = self._lines[path]
        file.write(dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":")) + "\n")
        file.flush()

    def close(self) -> None:
        """Syncs the files to disk and releases the folder (twice is harmless)."""
        for file in self._lines.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()
        self._lines = {}
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
