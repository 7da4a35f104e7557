"""scripts/python.sh: the interpreter setup.sh builds .venv with (Python 3.11-3.13, else one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pick(python: str) -> subprocess.CompletedProcess[str]:
    script = f". {REPO / 'scripts' / 'python.sh'}; pick_python"
    env = {**os.environ, "PYTHON": python}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def test_a_supported_python_is_picked() -> None:
    result = _pick(sys.executable)  # the suite runs on 3.11-3.13
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sys.executable


def test_an_unsupported_or_missing_python_fails_in_one_line(tmp_path: Path) -> None:
    old = tmp_path / "python3.10"  # an interpreter that reports 3.10
    old.write_text("#!/bin/sh\necho 3.10\n")
    old.chmod(0o755)
    for python, says in ((str(old), "is Python 3.10"), (str(tmp_path / "nope"), "not a runnable")):
        result = _pick(python)
        assert result.returncode == 1 and result.stdout == "", result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "3.11, 3.12 or 3.13" in lines[0], lines
