"""The import graph of ``mtpc/`` (docs/DESIGN.md, "Import graph"): no circle, counting
function-level and ``TYPE_CHECKING`` imports; ``mtpc/data/`` imports nothing from
``mtpc/evaluation/``, ``mtpc/decoding/`` or ``mtpc/training/``; ``mtpc/evaluation/`` (and the
regeneration job above it) nothing from ``mtpc/training/``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mtpc"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every ``mtpc`` name an import statement of the module names, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the module's package, level - 1 up
                parts = package.split(".")
                module = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [module])])
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {
        name: {m for m in _imported(name, path) if m in mods and m != name}
        for name, path in mods.items()
    }


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    # the check finds one when there is one (a function-level import counts)
    assert _circle({**graph, "mtpc.store": graph["mtpc.store"] | {"mtpc.evaluation.records"}})


def _imports_of(
    graph: dict[str, set[str]], low: tuple[str, ...], high: tuple[str, ...]
) -> set[str]:
    """``module -> dependency`` for every import of a module named ``low*`` from ``high*``."""
    return {
        f"{m} -> {dep}"
        for m, deps in graph.items()
        if m.startswith(low)
        for dep in deps
        if dep.startswith(high)
    }


def test_data_is_a_leaf_of_the_jobs(graph: dict[str, set[str]]) -> None:
    above = ("mtpc.evaluation", "mtpc.decoding", "mtpc.training")
    assert not _imports_of(graph, ("mtpc.data",), above)


def test_evaluation_does_not_import_training(graph: dict[str, set[str]]) -> None:
    """What both read (the fields that shape a draft, ``mtpc/draft_fields.py``; the record of
    the runs and their last draft, ``mtpc/last_draft.py``) lives below both."""
    assert not _imports_of(graph, ("mtpc.evaluation", "mtpc.regeneration"), ("mtpc.training",))
    # the check sees one when there is one
    wrong = {**graph, "mtpc.evaluation.statistics": {"mtpc.training.resume"}}
    assert _imports_of(wrong, ("mtpc.evaluation",), ("mtpc.training",))
