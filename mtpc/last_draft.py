"""The draft a bare ``python eval.py`` evaluates: the one ``<root>/outputs/last_draft.txt``
names, unless the run that wrote it overlapped another run in time (docs/TRAINING.md, "The
last draft"). Exporting runs record themselves in ``outputs/runs.json`` from start to export;
every write is atomic and under ``outputs/.runs.lock``, ``runs.json`` before the marker, so a
reader needs no lock. A marker with no record names its draft as it always did.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mtpc.errors import UserError
from mtpc.files import pid_alive, write_text_atomic

MARKER = "last_draft.txt"
RUNS = "runs.json"
LOCK = ".runs.lock"
KEEP = 64  # finished runs kept in runs.json (the newest); unfinished ones always stay
TRAIN_HINT = "train one with `python train.py` or pass draft=<exported draft dir>"


class LastDraftOverlapError(UserError):
    """The last finished training run overlapped another run of the same root in time."""


def _outputs(root: str | Path) -> Path:
    return Path(root) / "outputs"


def read_runs(root: str | Path) -> list[dict[str, Any]]:
    """The recorded runs of ``root`` (oldest first; [] without a record or an unreadable one)."""
    try:
        runs = json.loads((_outputs(root) / RUNS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


@contextlib.contextmanager
def _locked_runs(root: str | Path) -> Iterator[list[dict[str, Any]]]:
    """The record, to change in place; written back (atomically) under the lock on leaving."""
    import fcntl

    outputs = _outputs(root)
    outputs.mkdir(parents=True, exist_ok=True)
    with open(outputs / LOCK, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocking: held for a read and a rename
        runs = read_runs(root)
        yield runs
        finished = [r for r in runs if r.get("finished") is not None]
        dropped = {id(r) for r in finished[: max(0, len(finished) - KEEP)]}
        kept = [r for r in runs if id(r) not in dropped]
        write_text_atomic(outputs / RUNS, json.dumps(kept, indent=2) + "\n")


def _alive(run: dict[str, Any]) -> bool:
    """Whether an unfinished run may still be running (its process, where it can be seen)."""
    if run.get("host") != socket.gethostname() or not isinstance(run.get("pid"), int):
        return True  # another machine's: cannot tell
    return pid_alive(run["pid"])


@contextlib.contextmanager
def recorded_run(
    root: str | Path, run_dir: Path, enabled: bool = True
) -> Iterator[Callable[[Path], None]]:
    """Records a training run in ``root``'s ``outputs/runs.json`` for the block's duration;
    yields ``exported(draft_dir)``, which marks it finished and points ``last_draft.txt`` at
    the draft. A block left by an exception takes the run out of the record (it exported
    nothing, or its export failed). ``enabled=False``: records nothing (off global rank 0, a
    run that exports no draft), and ``exported`` only writes the marker."""
    if not enabled:
        yield lambda draft_dir: _point_marker(root, draft_dir)
        return
    run_id = uuid.uuid4().hex
    with _locked_runs(root) as runs:
        runs[:] = [r for r in runs if r.get("finished") is not None or _alive(r)]
        runs.append({
            "id": run_id, "run_dir": str(Path(run_dir).resolve()), "draft": None,
            "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "finished": None,
        })  # fmt: skip

    def exported(draft_dir: Path) -> None:
        draft = str(Path(draft_dir).resolve())
        with _locked_runs(root) as runs:
            for run in runs:
                if run.get("id") == run_id:
                    run.update(draft=draft, finished=time.time())
            _point_marker(root, draft_dir)  # after runs.json: a reader sees the run first

    try:
        yield exported
    except BaseException:
        with _locked_runs(root) as runs:
            runs[:] = [r for r in runs if r.get("id") != run_id]
        raise


def _point_marker(root: str | Path, draft_dir: Path) -> None:
    outputs = _outputs(root)
    outputs.mkdir(parents=True, exist_ok=True)
    write_text_atomic(outputs / MARKER, str(Path(draft_dir).resolve()) + "\n")


def _overlaps(run: dict[str, Any], last: dict[str, Any]) -> bool:
    if run is last or run.get("started") is None:
        return False
    if run.get("finished") is None and not _alive(run):
        return False  # killed: it exported nothing
    end = run.get("finished")
    return run["started"] < last["finished"] and (end is None or end > last["started"])


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def last_draft(root: str | Path) -> str:
    """The draft ``last_draft.txt`` names (what a bare ``eval.py`` evaluates).

    Raises:
        FileNotFoundError: no training run has exported a draft under ``root``.
        LastDraftOverlapError: the run that exported it overlapped another run in time.
    """
    marker = _outputs(root) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"no draft given and {marker} does not exist: {TRAIN_HINT}")
    draft = marker.read_text(encoding="utf-8").strip()
    runs = read_runs(root)
    mine = [r for r in runs if r.get("draft") == draft and r.get("finished") is not None]
    if not mine:
        return draft  # a marker without a record: as it always was
    last = max(mine, key=lambda r: r["finished"])
    others = [r for r in runs if _overlaps(r, last)]
    if not others:
        return draft
    named = "; ".join(
        f"{r['draft']} (finished {_when(r['finished'])})"
        if r.get("finished") is not None
        else f"{Path(r['run_dir']) / 'draft'} (still training, pid {r.get('pid')} on {r.get('host')})"
        for r in others
    )
    raise LastDraftOverlapError(
        f"no draft given, and {marker} may name another run's draft than the one you mean: it "
        f"names {draft} (trained {_when(last['started'])} to {_when(last['finished'])}), and "
        f"{named} trained at the same time; pick one with draft=<dir>"
    )
