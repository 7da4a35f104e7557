"""The code's pointers into ``docs/``: module and function docstrings say a thing once and point
at the document that holds the prose (``docs/X.md, "Section"``). A pointer to a file or a
section that does not exist fails here, so the prose cannot silently go missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# docs/X.md, optionally closed by `` (rst literal), then optionally , or : and a "Section" (or
# 'Section' inside a message string)
POINTER = re.compile(r"""docs/([A-Z_]+\.md)(?:``)?(?:[,:]?\s+(["'])([^"'\n]+)\2)?""")


def _headings(doc: Path) -> list[str]:
    """A document's headings and its paragraphs' bold run-in titles (``**Load-time check**``)."""
    lines = doc.read_text().splitlines()
    titles = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    return titles + [line[2:].split("**")[0] for line in lines if line.startswith("**")]


def _pointers() -> list[tuple[str, str, str | None]]:
    files = [*ROOT.joinpath("mtpc").rglob("*.py"), *ROOT.joinpath("scripts").glob("*.py")]
    found = []
    for path in files:
        # docstrings wrap: a pointer may continue on the next line after its indentation
        text = re.sub(r"\n\s*", " ", path.read_text())
        for name, _, section in POINTER.findall(text):
            found.append((str(path.relative_to(ROOT)), name, section or None))
    return found


def test_code_points_at_documents_and_sections_that_exist() -> None:
    pointers = _pointers()
    assert len(pointers) >= 10  # the code does point into docs/
    missing = []
    for where, name, section in pointers:
        doc = ROOT / "docs" / name
        if not doc.is_file():
            missing.append(f"{where}: docs/{name}")
        elif section and not any(h.startswith(section) for h in _headings(doc)):
            missing.append(f'{where}: docs/{name}, "{section}"')
    assert not missing, "pointers to nothing:\n" + "\n".join(missing)


def test_a_pointer_to_a_missing_section_is_caught(tmp_path: Path) -> None:
    text = 'See docs/DECODING.md, "No such section".'
    name, _, section = POINTER.findall(text)[0]
    assert (name, section) == ("DECODING.md", "No such section")
    assert not any(h.startswith(section) for h in _headings(ROOT / "docs" / name))
