"""Errors a person can read (issue 13, items 7, 8, 9): no traceback for a user's mistake.

The command-line tests run ``train.py`` / ``eval.py`` in a subprocess and fail before any
model or data is loaded, so each takes a few seconds (the imports).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    environ.pop("HYDRA_FULL_ERROR", None)
    environ.update(env)
    command = [sys.executable, str(REPO / script), *args, f"hydra.run.dir={tmp_path / 'out'}"]
    return subprocess.run(command, env=environ, cwd=tmp_path, capture_output=True, text=True)


def test_user_errors_print_one_or_two_lines_without_a_traceback(tmp_path: Path) -> None:
    bad = _run("train.py", ["circuit=ff", "circuit.rank=4"], tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr  # was: Hydra's "Error executing job" + traceback
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2 and "circuit.rank=4" in lines[-1], bad.stderr

    # the same mistake with HYDRA_FULL_ERROR=1 keeps the whole trace
    full = _run("train.py", ["circuit=ff", "circuit.rank=4"], tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "Traceback" in full.stderr and "ConfigError" in full.stderr

    # eval.py: a training run folder given as draft= names its draft/ folder
    run_dir = tmp_path / "outputs" / "train" / "myrun"
    (run_dir / "draft").mkdir(parents=True)
    (run_dir / "draft" / "config.json").write_text("{}")
    wrong = _run("eval.py", [f"draft={run_dir}"], tmp_path)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]
    assert f"draft={run_dir / 'draft'}" in wrong.stderr

    missing = _run("eval.py", [f"draft={tmp_path / 'nope'}"], tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "nope" in missing.stderr


def test_a_bug_keeps_its_traceback() -> None:
    from mtpc.errors import run_reporting_user_errors

    def bug() -> None:
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_reporting_user_errors(bug, also=(FileNotFoundError,))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=0", r"optimizer\.lr=0 is not allowed; allowed: a number > 0"),
        ("optimizer.lr=fast", r"optimizer\.lr='fast' is not allowed"),
        ("trainer.max_steps=-2", r"trainer\.max_steps=-2 is not allowed; allowed: an integer >= 1"),
        ("callbacks.checkpoint_every_n_steps=0", r"callbacks\.checkpoint_every_n_steps=0"),
        ("model.path=/no/such/model", r"model\.path='/no/such/model' does not exist"),
    ],
)
def test_bad_settings_fail_at_startup(override: str, message: str) -> None:
    from hydra import compose, initialize_config_dir

    from mtpc.config import ConfigError, validate_train_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[override])
    with pytest.raises(ConfigError, match=message):
        validate_train_config(cfg)  # was: accepted, failing a minute later in torch's words


def test_a_head_too_big_for_memory_is_refused_with_the_numbers(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mtpc.config import ConfigError
    from mtpc.training.run import train

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["circuit.rank=1000000", "logger=none"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "run")
        cfg.paths.cache_dir = str(tmp_path / "cache")
    with pytest.raises(
        ConfigError, match=r"needs about [\d.]+ GiB.*8\*1000000\*320\*128.*GiB free"
    ):
        train(cfg)  # was: the allocator asked for 1.3 TB
    assert not (tmp_path / "cache").exists()  # before data preparation
