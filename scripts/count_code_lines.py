"""Lines of code of the Python files under a folder: physical lines that hold a token of code,
so blank lines, comments and docstrings (the first statement of a module, class or function,
when it is a string) do not count; a statement over several lines counts each of them.

    python scripts/count_code_lines.py                 # mtpc/: per file, then the total
    python scripts/count_code_lines.py tests --json    # another folder, as JSON

Read with ``tokenize`` (which tokens sit on which lines) and ``ast`` (which strings are
docstrings); nothing is imported. A line holding a docstring and code (``def f(): "Doc."``)
counts once.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_CODE = {
    tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
    tokenize.ENDMARKER,
}  # fmt: skip
HAS_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

Position = tuple[int, int]  # (line, column), as tokenize and ast give them


def docstring_spans(source: str) -> list[tuple[Position, Position]]:
    """Where each docstring of ``source`` starts and ends (columns in characters, as tokenize
    counts them; ast counts UTF-8 bytes)."""
    lines = source.splitlines(keepends=True)

    def at(line: int, byte: int) -> Position:
        return line, len(lines[line - 1].encode()[:byte].decode(errors="ignore"))

    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, HAS_DOCSTRING) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            assert first.end_lineno is not None and first.end_col_offset is not None
            spans.append(
                (at(first.lineno, first.col_offset), at(first.end_lineno, first.end_col_offset))
            )
    return spans


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code (see the module docstring)."""
    docs = docstring_spans(source)
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in NOT_CODE:
            continue
        if any(start <= tok.start and tok.end <= end for start, end in docs):
            continue  # a docstring (or a piece of an implicitly concatenated one)
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def count_folder(folder: Path) -> dict[str, int]:
    """Lines of code of every ``*.py`` under ``folder``, by path relative to it (sorted)."""
    return {
        str(path.relative_to(folder)): code_lines(path.read_text(encoding="utf-8"))
        for path in sorted(folder.rglob("*.py"))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=ROOT / "mtpc")
    parser.add_argument("--json", action="store_true", help="one JSON object: files and total")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    counts = count_folder(args.folder)
    total = sum(counts.values())
    if args.json:
        print(json.dumps({"folder": str(args.folder), "files": counts, "total": total}, indent=2))
        return 0
    width = max((len(name) for name in counts), default=5)
    for name, lines in counts.items():
        print(f"{name:<{width}}  {lines:>6}")
    print(f"{'total':<{width}}  {total:>6}  ({len(counts)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
