"""The code's pointers into ``docs/``: module and function docstrings say a thing once and point
at the document that holds the prose (``docs/X.md, "Section"``). A pointer to a file or a
section that does not exist fails here, so the prose cannot silently go missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUOTED = r"""(?:"[^"]+"|'[^'\s][^']*?'(?![a-z]))"""  # "Section" ("The paper's drafts"), 'Section'
# docs/X.md (`` may close an rst literal), then , or : and a quoted section, then "and" more
POINTER = re.compile(
    rf"docs/\s?([A-Z_]+\.md)(?:``)?((?:[,:]?\s+{QUOTED})(?:,?\s+and\s+{QUOTED})*)?"
)


def _headings(doc: Path) -> list[str]:
    """A document's headings and its paragraphs' bold run-in titles (``**Load-time check**``)."""
    lines = doc.read_text().splitlines()
    titles = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    return titles + [line[2:].split("**")[0] for line in lines if line.startswith("**")]


def _names(doc: Path, section: str) -> bool:
    """``section`` is a heading or title of ``doc``, whole or before its `` (...)``/``:`` tail."""
    return any(
        h == section or h.startswith((f"{section} (", f"{section}:")) for h in _headings(doc)
    )


def _pointers() -> list[tuple[str, str, str | None]]:
    files = [*ROOT.joinpath("mtpc").rglob("*.py"), *ROOT.joinpath("scripts").glob("*.py")]
    found = []
    for path in files:
        # docstrings wrap: a pointer may continue on the next line after its indentation
        text = re.sub(r"\n\s*", " ", path.read_text())
        for name, sections in POINTER.findall(text):
            where = str(path.relative_to(ROOT))
            quoted = [q[1:-1] for q in re.findall(QUOTED, sections)]
            found += [(where, name, section) for section in quoted] or [(where, name, None)]
    return found


def test_code_points_at_documents_and_sections_that_exist() -> None:
    pointers = _pointers()
    assert len(pointers) >= 10  # the code does point into docs/
    missing = []
    for where, name, section in pointers:
        doc = ROOT / "docs" / name
        if not doc.is_file():
            missing.append(f"{where}: docs/{name}")
        elif section and not _names(doc, section):
            missing.append(f'{where}: docs/{name}, "{section}"')
    assert not missing, "pointers to nothing:\n" + "\n".join(missing)


def test_a_pointer_to_a_missing_section_is_caught() -> None:
    text = """See docs/DECODING.md, "The cycle" and "No such section"; docs/\nEVALUATION.md, "The
        paper's drafts"."""
    flat = re.sub(r"\n\s*", " ", text)
    found = [(m.group(1), [q[1:-1] for q in re.findall(QUOTED, m.group(2))])
             for m in POINTER.finditer(flat)]  # fmt: skip
    assert found == [("DECODING.md", ["The cycle", "No such section"]),
                     ("EVALUATION.md", ["The paper's drafts"])]  # fmt: skip
    assert _names(ROOT / "docs/DECODING.md", "The cycle")
    assert not _names(ROOT / "docs/DECODING.md", "No such section")
    assert not _names(ROOT / "docs/DECODING.md", "The")  # a prefix is not a section
