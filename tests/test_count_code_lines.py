"""``scripts/count_code_lines.py``: lines of code without docstrings, comments and blanks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "count_code_lines", REPO / "scripts" / "count_code_lines.py"
)
assert _spec is not None and _spec.loader is not None
counter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counter)

SOURCE = '''"""The module's docstring,
over two lines."""

import os  # 1 (the comment does not make it two)

# a comment line


class Thing:  # 2
    """A class docstring."""

    size = 3  # 3

    def grow(self, by: int) -> int:  # 4
        """A method's docstring
        over three
        lines."""
        total = (  # 5
            self.size  # 6
            + by  # 7
        )  # 8
        note = """a string that is not a docstring:
        it counts, line by line"""  # 9, 10
        return total  # 11


def tiny(): "A docstring on the line of its def: the def counts."  # 12


async def later():  # 13
    ("An implicitly " "concatenated docstring")
    return os.sep  # 14
'''


def test_docstrings_comments_and_blanks_do_not_count() -> None:
    assert counter.code_lines(SOURCE) == 14
    assert counter.code_lines("") == 0
    assert counter.code_lines('"""Only a docstring."""\n# and a comment\n\n') == 0
    assert counter.code_lines('x = "ü"; y = 1\ndef f(): "ü doc"\n') == 2


def test_the_folder_per_file_and_total(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(SOURCE)
    (tmp_path / "b.py").write_text("x = [\n    1,\n    2,\n]\n")  # one expression, 4 lines
    (tmp_path / "notes.txt").write_text("not python\n")
    assert counter.main([str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == {"b.py": 4, "pkg/a.py": 14} and report["total"] == 18
    assert counter.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split()[:2] == ["total", "18"] and lines[0].split() == ["b.py", "4"]
    assert counter.main([str(tmp_path / "none")]) == 2
    assert "is not a folder" in capsys.readouterr().err
