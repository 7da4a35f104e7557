"""The draft a bare ``eval.py`` evaluates (``mtpc/last_draft.py``): the last training run's,
refused in one line when that run overlapped another run of the same root."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mtpc.evaluation.loading import resolve_drafts
from mtpc.last_draft import LastDraftOverlapError, last_draft, read_runs, recorded_run
from tests.helpers import compose_train_cfg

REPO = Path(__file__).resolve().parents[1]
FAST = [  # a few steps on the tiny target (as tests/test_training.py's)
    "data.num_rows=300", "data.seq_len=96", "data.batch_size=4", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "trainer.limit_val_batches=2", "loss.chunk_size=128",
    "circuit=ff", "circuit.window=2", "trainer.max_steps=2", "validate_before_training=false",
]  # fmt: skip


def _draft(root: Path, name: str) -> Path:
    """A folder standing for an exported draft (the record only names it)."""
    path = root / "outputs" / "train" / name / "draft"
    path.mkdir(parents=True)
    return path


def _write_runs(root: Path, runs: list[dict]) -> None:
    (root / "outputs").mkdir(parents=True, exist_ok=True)
    (root / "outputs" / "runs.json").write_text(json.dumps(runs))


def _run(name: str, root: Path, started: float, finished: float | None, **more: object) -> dict:
    draft = None if finished is None else str(root / "outputs" / "train" / name / "draft")
    return {"id": name, "run_dir": str(root / "outputs" / "train" / name), "draft": draft,
            "pid": os.getpid(), "host": socket.gethostname(), "started": started,
            "finished": finished, **more}  # fmt: skip


def test_one_run_after_another_names_the_last(tmp_path: Path) -> None:
    a, b = _draft(tmp_path, "a"), _draft(tmp_path, "b")
    for draft in (a, b):
        with recorded_run(tmp_path, draft.parent) as exported:
            exported(draft)
    assert last_draft(tmp_path) == str(b.resolve())
    runs = read_runs(tmp_path)
    assert [r["draft"] for r in runs] == [str(a.resolve()), str(b.resolve())]
    assert runs[0]["finished"] <= runs[1]["started"]


def test_a_run_that_overlapped_another_is_refused_in_one_line(tmp_path: Path) -> None:
    a, b = _draft(tmp_path, "a"), _draft(tmp_path, "b")
    with recorded_run(tmp_path, a.parent) as exported_a, recorded_run(tmp_path, b.parent) as b_:
        exported_a(a)
        with pytest.raises(LastDraftOverlapError) as still:  # b is still training
            last_draft(tmp_path)
        b_(b)
    message = str(still.value)
    assert "\n" not in message and str(a.resolve()) in message and "draft=<dir>" in message
    assert f"{b.parent.resolve() / 'draft'} (still training" in message
    with pytest.raises(LastDraftOverlapError) as both:
        last_draft(tmp_path)
    message = str(both.value)
    assert "\n" not in message and "draft=<dir>" in message
    assert str(a.resolve()) in message and str(b.resolve()) in message
    # a later run alone is the last one again
    c = _draft(tmp_path, "c")
    with recorded_run(tmp_path, c.parent) as exported:
        exported(c)
    assert last_draft(tmp_path) == str(c.resolve())


def test_failed_and_killed_runs_do_not_count(tmp_path: Path) -> None:
    a = _draft(tmp_path, "a")
    with pytest.raises(RuntimeError), recorded_run(tmp_path, tmp_path / "failed"):
        raise RuntimeError("no step taken")
    assert read_runs(tmp_path) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    killed = _run("killed", tmp_path, 0.0, None, pid=int(dead.stdout))
    elsewhere = _run("elsewhere", tmp_path, 0.0, None, host="another-host")
    _write_runs(tmp_path, [killed, elsewhere])
    with recorded_run(tmp_path, a.parent) as exported:
        exported(a)
    runs = read_runs(tmp_path)
    assert [r["id"] for r in runs[:-1]] == ["elsewhere"]  # the killed one dropped at the start
    with pytest.raises(LastDraftOverlapError, match=r"still training, pid .* on another-host"):
        last_draft(tmp_path)  # another machine's unfinished run: cannot tell, so refused


def test_a_marker_without_a_record_names_its_draft(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"python train\.py"):
        last_draft(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "last_draft.txt").write_text("/some/draft\n")
    assert last_draft(tmp_path) == "/some/draft"
    _write_runs(tmp_path, [_run("x", tmp_path, 1.0, 2.0), _run("y", tmp_path, 1.5, 3.0)])
    assert last_draft(tmp_path) == "/some/draft"  # the record holds other drafts only


def test_a_single_training_run_is_what_a_bare_eval_finds(tmp_path: Path) -> None:
    from mtpc.training.run import train

    train(compose_train_cfg(tmp_path, [], "single", fast=FAST))
    draft = (tmp_path / "single" / "draft").resolve()
    assert resolve_drafts(None, tmp_path) == [draft]  # what a bare eval.py evaluates
    [run] = read_runs(tmp_path)
    assert run["draft"] == str(draft) and run["run_dir"] == str(draft.parent)
    assert run["pid"] == os.getpid() and run["started"] < run["finished"]


@pytest.mark.slow
def test_two_trainings_at_once_leave_a_bare_eval_refusing(tmp_path: Path) -> None:
    """Two ``train.py`` processes in one root at the same time: ``last_draft.txt`` names
    whichever exported last, so a bare ``eval.py`` refuses in one line naming both drafts."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, str(REPO / "train.py"), *FAST, "logger=none"]
    runs = [
        subprocess.Popen(
            [*command, f"run_name={name}"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    for proc in runs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    drafts = [tmp_path / "outputs" / "train" / name / "draft" for name in ("a", "b")]
    recorded = read_runs(tmp_path)
    assert sorted(r["draft"] for r in recorded) == sorted(str(d.resolve()) for d in drafts)
    first, second = sorted(recorded, key=lambda r: r["finished"])
    assert second["started"] < first["finished"], "the two runs did not overlap"
    bare = subprocess.run(
        [sys.executable, str(REPO / "eval.py"), "num_prompts=1", "num_prompt_sets=1",
         f"hydra.run.dir={tmp_path / 'eval'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert bare.returncode == 2, bare.stderr[-3000:]
    lines = bare.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), bare.stderr[-3000:]
    assert "Traceback" not in bare.stderr and "draft=<dir>" in lines[0]
    assert all(str(d.resolve()) in lines[0] for d in drafts)
    # naming one of them evaluates it
    chosen = resolve_drafts(str(drafts[0]), tmp_path)
    assert chosen == [drafts[0]]
