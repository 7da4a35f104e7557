"""Real text every machine has offline: the running interpreter's Python standard library.

Tülu-schema rows (plus ``file``) cut from the ``.py`` files under a root: function bodies,
docstrings and continuations, each kind its own ``source``. Files read, malformed files, the split
by file and the fingerprint: docs/DATA.md, "Python source code". The split is a hash of the relative
path alone, so no seed enters and adding or removing files never moves another file.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from mtpc.data.rows import Row, RowSource
from mtpc.errors import DataError, MissingFileError

logger = logging.getLogger(__name__)

PYTHON_CODE_VERSION = 1  # bump when the rows change for the same files (stale caches)

KINDS = ("function_body", "docstring", "continuation")
SOURCE_PREFIX = "python/"

EXCLUDED_DIRS = frozenset(  # folder names never read, at any depth below the root
    {
        "test",  # CPython's regression tests (17 MB on 3.11), also unittest/test, ctypes/test ...
        "tests",  # distutils/tests and other packages' tests
        "idle_test",
        "idlelib",  # the IDLE application
        "lib2to3",  # deprecated, with its own test data of deliberately odd code
        "turtledemo",
        "pydoc_data",  # one generated 750 kB string table
        "encodings",  # generated codec tables (charmap dicts)
        "site-packages",  # third-party packages installed into the interpreter
        "dist-packages",
        "__pycache__",
    }
)

MAX_FILE_BYTES = 256 * 1024  # larger files are counted as ``too_large``: no rows
CONTINUATION_LINES = 16  # lines per block: block 2k is a prompt, block 2k+1 its answer

MALFORMED_REASONS = ("undecodable", "syntax_error", "too_large")


def python_version() -> str:
    """``major.minor.micro`` of the running interpreter (part of the fingerprint)."""
    return ".".join(map(str, sys.version_info[:3]))


def is_validation_file(relpath: str, validation_fraction: float) -> bool:
    """Whether the file at ``relpath`` (POSIX, relative to the root) is held out."""
    digest = hashlib.sha256(f"mtpc-python-split:{relpath}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the ``.py`` files read under ``root``, in reading order."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        rel_dir = Path(dirpath).relative_to(root)
        out.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    # a hash order, so that the first rows come from many folders
    return sorted(out, key=lambda rel: hashlib.sha256(f"mtpc-python-order:{rel}".encode()).digest())


@dataclass
class FileReport:
    """What happened to the files of one source (``summary.json``'s ``source_report``)."""

    root: str
    python_version: str
    excluded_dirs: list[str]
    files_seen: int = 0
    files_used: int = 0
    train_files: int = 0
    validation_files: int = 0
    malformed_files: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MALFORMED_REASONS, 0)
    )
    malformed_examples: dict[str, list[str]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    functions_without_body: int = 0


def _dedent(lines: list[str], column: int) -> list[str]:
    """``lines`` without their first ``column`` characters when all non-blank ones are spaces."""
    prefix = " " * column
    if column and all(line.startswith(prefix) or not line.strip() for line in lines):
        return [line[column:] if line.strip() else line.lstrip(" ") for line in lines]
    return lines


def _function_rows(
    tree: ast.AST, lines: list[str], relpath: str, kinds: Sequence[str], report: FileReport
) -> Iterator[Row]:
    """``function_body`` and ``docstring`` rows of every documented function in ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node, clean=False) is None:
            continue
        doc = node.body[0]
        assert doc.end_lineno is not None and node.end_lineno is not None
        if len(node.body) < 2 or node.body[1].lineno <= doc.end_lineno:
            report.functions_without_body += 1  # only a docstring, or code on its last line
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        text = _dedent(lines[first - 1 : node.end_lineno], node.col_offset)
        header = text[: doc.end_lineno - first + 1]  # decorators, signature, docstring
        body = text[doc.end_lineno - first + 1 :]
        docstring = text[doc.lineno - first : doc.end_lineno - first + 1]
        signature = text[: doc.lineno - first]
        asks = []  # (kind, the part asked for, the lines the user turn shows, the answer's)
        if "function_body" in kinds:
            asks.append(("function_body", "body", header, body))
        if "docstring" in kinds and doc.lineno > node.lineno:
            asks.append(("docstring", "docstring", signature + body, docstring))
        for kind, part, shown, answer in asks:
            user = f"Write the {part} of this Python function from `{relpath}`.\n\n"
            row_id = f"{kind}:{relpath}:{node.lineno}:{node.name}"
            yield _row(row_id, kind, relpath, user + "".join(shown), "".join(answer))


def _continuation_rows(lines: list[str], relpath: str) -> Iterator[Row]:
    """Blocks 2k (prompt) and 2k+1 (answer) of ``CONTINUATION_LINES`` lines each."""
    step = 2 * CONTINUATION_LINES
    for start in range(0, len(lines), step):
        prompt = "".join(lines[start : start + CONTINUATION_LINES])
        answer = "".join(lines[start + CONTINUATION_LINES : start + step])
        if not prompt.strip() or not answer.strip():
            continue
        yield _row(
            f"continuation:{relpath}:{start + 1}",
            "continuation",
            relpath,
            f"Continue this Python code from `{relpath}`.\n\n{prompt}",
            answer,
        )


def _row(row_id: str, kind: str, relpath: str, user: str, assistant: str) -> Row:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"id": row_id, "messages": messages, "source": SOURCE_PREFIX + kind, "file": relpath}


def file_rows(
    source: bytes, relpath: str, kinds: Sequence[str], report: FileReport
) -> list[Row] | None:
    """The rows of one file, or None when it is malformed (counted in ``report``)."""
    reason = "too_large"
    if len(source) <= MAX_FILE_BYTES:
        try:
            text = source.decode("utf-8")
            tree = ast.parse(text, filename=relpath)
        except UnicodeDecodeError:
            reason = "undecodable"
        except (SyntaxError, ValueError):  # ValueError: null bytes
            reason = "syntax_error"
        else:
            lines = text.splitlines(keepends=True)
            rows = list(_function_rows(tree, lines, relpath, kinds, report))
            if "continuation" in kinds:
                rows.extend(_continuation_rows(lines, relpath))
            return rows
    report.malformed_files[reason] += 1
    examples = report.malformed_examples.setdefault(reason, [])
    if len(examples) < 5:
        examples.append(relpath)
    return None


@dataclass
class _Built:
    rows: list[Row]
    validation: list[bool]
    report: FileReport


def _build(
    folder: Path,
    files: Sequence[str],
    kinds: Sequence[str],
    limit: int | None,
    validation_fraction: float,
    label: str,
) -> _Built:
    """Parses ``files`` (under ``folder``) into rows and their split (``python_code_source``);
    ``limit``: the rows kept (None: all)."""
    report = FileReport(str(folder), python_version(), sorted(EXCLUDED_DIRS))
    rows: list[Row] = []
    validation: list[bool] = []
    n_val = 0
    if limit is not None and validation_fraction > 0:
        n_val = min(max(1, round(validation_fraction * limit)), limit - 1)
    held = 0  # validation rows so far
    for relpath in files:
        if limit is not None and held >= n_val and len(rows) - held >= limit - n_val:
            break  # enough rows on both sides: read no further
        report.files_seen += 1
        got = file_rows((folder / relpath).read_bytes(), relpath, kinds, report)
        if got is None:
            continue
        report.files_used += 1
        held_out = is_validation_file(relpath, validation_fraction)
        report.validation_files += held_out
        report.train_files += not held_out
        rows.extend(got)
        validation.extend([held_out] * len(got))
        held += len(got) if held_out else 0
    if limit is not None:
        keep_val = [i for i, v in enumerate(validation) if v][:n_val]
        keep_train = [i for i, v in enumerate(validation) if not v][: limit - n_val]
        keep = sorted(keep_val + keep_train)
        rows = [rows[i] for i in keep]
        validation = [validation[i] for i in keep]
    report.rows = dict(Counter(row["source"] for row in rows))
    bad = {k: v for k, v in report.malformed_files.items() if v}
    if bad:
        logger.warning(
            "%s: %d of %d files are malformed and give no rows: %s (first: %s)",
            label,
            sum(bad.values()),
            report.files_seen,
            bad,
            report.malformed_examples,
        )
    logger.info(
        "%s: %d rows from %d files (%d train / %d validation files) %s",
        label,
        len(rows),
        report.files_used,
        report.train_files,
        report.validation_files,
        report.rows,
    )
    return _Built(rows, validation, report)


def python_code_source(
    root: str | os.PathLike[str] | None = None,
    num_rows: int | None = None,
    validation_fraction: float = 0.05,
    kinds: Sequence[str] = KINDS,
) -> RowSource:
    """Rows cut from the ``.py`` files under ``root`` (None: the standard library). The files are
    hashed up front (the fingerprint) and parsed into rows on first use, once: a cache hit never
    parses. ``DataError`` for an unknown kind, a fraction outside [0, 1), ``num_rows`` < 1 or a root
    without ``.py`` files; ``MissingFileError`` for a non-folder."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise DataError(f"python_code kinds={list(kinds)}; allowed: a non-empty subset of {KINDS}")
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(
            f"data.validation_fraction={validation_fraction}; allowed: a number in [0, 1)"
        )
    limit = None if num_rows is None else int(num_rows)
    if limit is not None and limit < 1:
        raise DataError(f"data.num_rows={num_rows}; allowed: null (every row) or a positive count")
    is_stdlib = root is None
    folder = Path(sysconfig.get_paths()["stdlib"] if root is None else root).expanduser()
    if not folder.is_dir():
        raise MissingFileError(
            f"data.path={str(folder)!r} is not a folder; allowed: a folder of .py files, or "
            "null for the running interpreter's standard library"
        )
    files = list_files(folder)
    if not files:
        raise DataError(f"data.path={str(folder)!r} holds no .py file outside {EXCLUDED_DIRS}")
    content = hashlib.sha256()
    for relpath in files:
        data = (folder / relpath).read_bytes()
        content.update(f"{relpath}\0{len(data)}\0".encode())
        content.update(data)
    where = "stdlib" if is_stdlib else f"path={folder.resolve()}"
    label = f"python{python_version()}-{'stdlib' if is_stdlib else folder.name}"
    fingerprint = (
        f"python_code:v{PYTHON_CODE_VERSION}:py{python_version()}:{where}:"
        f"kinds={','.join(kinds)}:val{validation_fraction:g}:n{num_rows}:"
        f"{content.hexdigest()[:32]}"
    )
    build = cache(lambda: _build(folder, files, kinds, limit, validation_fraction, label))
    return RowSource(
        name=label if num_rows is None else f"{label}[:{num_rows}]",
        fingerprint=fingerprint,
        iter_rows=lambda: iter(build().rows),
        take_rows=lambda positions: [build().rows[int(p)] for p in positions],
        row_limit=limit,
        split_mask=lambda: build().validation,
        report=lambda: asdict(build().report),
    )
