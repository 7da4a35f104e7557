"""Layered ("folded") circuit structures and the builders of the four MTPC families.

Index tensors are computed once, here, at build time. A family is a builder that creates
nodes with :class:`StructureBuilder` and returns the root; ``STRUCTURES`` is their registry.
See docs/CIRCUITS.md, "Structures" and "Adding a structure".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from mtpc.choices import CIRCUIT_KINDS

LayerKind = Literal["input", "product", "sum"]


@dataclass(frozen=True)
class Slot:
    """Where the ``a``-th child of every fold of a layer lives."""

    sources: tuple[int, ...]  # layer ids the children come from (usually one)
    index: Tensor  # (F,) each child's fold in the concatenation of ``sources``
    start: int | None  # children = folds start, start + 1, ... of one source; None: gather
    parts: tuple[tuple[int, Tensor, Tensor], ...]  # per source: (source, folds, child folds)


@dataclass(frozen=True)
class Layer:
    """One layer of folded units."""

    kind: LayerKind
    num_folds: int  # F
    num_units: int  # r; 1 for the root
    slots: tuple[Slot, ...]  # one per child: A for products, 1 for sums, none for inputs
    # products: child a of fold f is fold view_start + f * A + a of the one source (a reshape)
    view_start: int | None
    sum_offset: int  # sums: fold f, unit j uses weight row sum_offset + f * num_units + j
    scopes: tuple[tuple[int, ...], ...]  # the window positions each fold depends on

    @property
    def arity(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class Structure:
    """A layered, smooth, decomposable, tree-shaped circuit over ``window`` positions."""

    kind: str
    window: int  # n
    rank: int  # r
    layers: tuple[Layer, ...]  # layers[0]: inputs; the last: the root alone
    num_sum_rows: int  # U, rows of length r of the sum-weight table
    sum_tie: Tensor  # (U,) each sum unit's parameter row (shared rows: homogeneous HMM)
    num_param_rows: int  # P
    param_unit: Tensor  # (P,) the output unit of each parameter row
    param_identity: Tensor  # (P,) bool: identity-initialised (weight on input param_unit)
    param_contextual: Tensor  # (P,) bool: depends on the context

    def __repr__(self) -> str:
        inner = ", ".join(f"{la.kind}[{la.num_folds}x{la.num_units}]" for la in self.layers[1:])
        return (
            f"Structure(kind={self.kind!r}, window={self.window}, rank={self.rank}, "
            f"layers=[{inner}], sum_units={self.num_sum_rows})"
        )


@dataclass
class _Node:
    kind: LayerKind
    units: int
    children: tuple[int, ...]
    scope: tuple[int, ...]
    tie: Hashable | None = None
    identity: bool = False
    contextual: bool = True


class StructureBuilder:
    """Creates the nodes of a circuit (0 .. n - 1: the inputs); :meth:`finish` folds them."""

    def __init__(self, kind: str, window: int, rank: int) -> None:
        self.kind, self.window, self.rank = kind, window, rank
        self.nodes: list[_Node] = [_Node("input", rank, (), (i,)) for i in range(window)]

    def leaf(self, position: int) -> int:
        """The input region of window position ``position``."""
        return position

    def product(self, *children: int) -> int:
        """A Hadamard product of regions with disjoint scopes (r units)."""
        scope: tuple[int, ...] = ()
        for c in children:
            if set(scope) & set(self.nodes[c].scope):
                raise ValueError(f"product children {children} overlap: not decomposable")
            scope += self.nodes[c].scope
        self.nodes.append(_Node("product", self.rank, tuple(children), tuple(sorted(scope))))
        return len(self.nodes) - 1

    def sum(
        self,
        child: int,
        units: int | None = None,
        *,
        tie: Hashable | None = None,
        identity: bool = False,
        contextual: bool = True,
    ) -> int:
        """A sum region mixing the r units of ``child`` into ``units`` (default r) units; sums
        with the same non-None ``tie`` share their parameter rows."""
        units = self.rank if units is None else units
        node = _Node("sum", units, (child,), self.nodes[child].scope, tie, identity, contextual)
        self.nodes.append(node)
        return len(self.nodes) - 1

    def finish(self, root: int) -> Structure:
        """Check the circuit and fold its nodes into layers (grouped by height and kind)."""
        n = self.window
        seen = self._check_tree(root)
        where: dict[int, tuple[int, int]] = {i: (0, i) for i in range(n)}  # node -> (layer, fold)
        layers = [Layer("input", n, self.rank, (), None, 0, tuple((i,) for i in range(n)))]
        rows = _SumRows()
        for (_, kind, arity, units), members in self._groups(seen):
            lid = len(layers)
            for f, v in enumerate(members):
                where[v] = (lid, f)
            children = [self.nodes[v].children for v in members]
            slots = tuple(
                _make_slot([where[ch[a]] for ch in children], layers) for a in range(arity)
            )
            flat = [where[c] for ch in children for c in ch]  # fold-major: f * A + a
            view_start = _run_start(flat) if kind == "product" else None
            offset = rows.add(self, members, units) if kind == "sum" else 0
            scopes = tuple(self.nodes[v].scope for v in members)
            layers.append(Layer(kind, len(members), units, slots, view_start, offset, scopes))  # type: ignore[arg-type]
        if where[root] != (len(layers) - 1, 0) or layers[-1].num_folds != 1:
            raise ValueError("the root must be alone in the last layer")
        return Structure(
            kind=self.kind,
            window=n,
            rank=self.rank,
            layers=tuple(layers),
            num_sum_rows=rows.count,
            sum_tie=torch.tensor(rows.tie, dtype=torch.long),
            num_param_rows=len(rows.unit),
            param_unit=torch.tensor(rows.unit, dtype=torch.long),
            param_identity=torch.tensor(rows.identity, dtype=torch.bool),
            param_contextual=torch.tensor(rows.contextual, dtype=torch.bool),
        )

    def _check_tree(self, root: int) -> set[int]:
        """Check the root, the tree shape and the children's units; the nodes under ``root``."""
        nodes = self.nodes
        if nodes[root].scope != tuple(range(self.window)):
            raise ValueError("the root must depend on every window position")
        if nodes[root].units != 1:
            raise ValueError("the root must have exactly one unit")
        # Tree shape: every node below the root is used exactly once.
        uses = [0] * len(nodes)
        stack, seen = [root], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            for c in nodes[v].children:
                uses[c] += 1
                stack.append(c)
        if any(uses[v] != (0 if v == root else 1) for v in range(len(nodes))):
            raise ValueError("every node must have exactly one parent (tree-shaped circuit)")
        for v in seen:
            nd = nodes[v]
            if nd.kind == "product" and any(nodes[c].units != self.rank for c in nd.children):
                raise ValueError("product children must all have r units")
            if nd.kind == "sum" and nodes[nd.children[0]].units != self.rank:
                raise ValueError("sum children must have r units")
        return seen

    def _groups(self, seen: set[int]) -> list[tuple[tuple[int, str, int, int], list[int]]]:
        """The inner nodes grouped into layers: ``((height, kind, arity, units), members)`` in
        layer order (by height, products first), members ordered by their first position."""
        nodes = self.nodes
        height = [0] * len(nodes)
        for v in range(len(nodes)):  # children are always created before parents
            if nodes[v].children:
                height[v] = 1 + max(height[c] for c in nodes[v].children)
        groups: dict[tuple[int, str, int, int], list[int]] = {}
        for v in sorted(seen):
            if nodes[v].kind != "input":
                nd = nodes[v]
                groups.setdefault((height[v], nd.kind, len(nd.children), nd.units), []).append(v)
        keys = sorted(groups, key=lambda k: (k[0], k[1] != "product", k[2], k[3]))
        return [(k, sorted(groups[k], key=lambda v: nodes[v].scope[0])) for k in keys]


@dataclass
class _SumRows:
    """The sum units' rows as :meth:`StructureBuilder.finish` lays them out, layer by layer."""

    count: int = 0  # U so far
    tie: list[int] = field(default_factory=list)  # Structure.sum_tie
    unit: list[int] = field(default_factory=list)  # Structure.param_* per parameter row
    identity: list[bool] = field(default_factory=list)
    contextual: list[bool] = field(default_factory=list)
    rows: dict[Hashable, int] = field(default_factory=dict)  # first row of each tie key

    def add(self, b: StructureBuilder, members: list[int], units: int) -> int:
        """Lay out one sum layer's rows; its ``sum_offset``."""
        offset = self.count
        for v in members:
            nd = b.nodes[v]
            if nd.identity and units != b.rank:
                raise ValueError("identity-initialised sums need r output units")
            key = ("node", v) if nd.tie is None else ("tie", nd.tie)
            if key not in self.rows:
                self.rows[key] = len(self.unit)
                self.unit.extend(range(units))
                self.identity.extend([nd.identity] * units)
                self.contextual.extend([nd.contextual] * units)
            self.tie.extend(range(self.rows[key], self.rows[key] + units))
        self.count += len(members) * units
        return offset


def _make_slot(children: list[tuple[int, int]], layers: list[Layer]) -> Slot:
    sources = tuple(sorted({lid for lid, _ in children}))
    index = torch.empty(len(children), dtype=torch.long)  # (F,)
    parts, offset = [], 0
    for s in sources:
        pos = [i for i, (lid, _) in enumerate(children) if lid == s]
        child = torch.tensor([children[i][1] for i in pos])  # int64: never empty
        index[pos] = offset + child
        parts.append((s, torch.tensor(pos), child))
        offset += layers[s].num_folds
    return Slot(sources, index, _run_start(children), tuple(parts))


def _run_start(children: list[tuple[int, int]]) -> int | None:
    """The first fold when ``children`` (layer, fold) are consecutive folds of one layer."""
    folds = [f for _, f in children]
    if len({lid for lid, _ in children}) != 1:
        return None
    return folds[0] if folds == list(range(folds[0], folds[0] + len(folds))) else None


def build_ff(b: StructureBuilder) -> int:
    """FF: the n input distributions under one product (rank 1)."""
    return b.product(*(b.leaf(i) for i in range(b.window)))


def build_cp(b: StructureBuilder) -> int:
    """CP: r fully factorised components (one product of r units) under one sum."""
    return b.sum(b.product(*(b.leaf(i) for i in range(b.window))), 1)


def build_hmm(
    b: StructureBuilder,
    *,
    homogeneous: bool = False,
    contextual: bool = True,
    identity: bool = True,
) -> int:
    """HMM with r hidden states truncated to n steps, built backwards (docs/CIRCUITS.md)."""
    node = b.leaf(b.window - 1)
    for i in range(b.window - 2, -1, -1):
        trans = b.sum(
            node,
            tie="transition" if homogeneous else None,
            identity=identity,
            contextual=contextual,
        )
        node = b.product(b.leaf(i), trans)
    return b.sum(node, 1)


def build_btree(b: StructureBuilder, *, identity: bool = False) -> int:
    """BTree: regions split recursively in halves (the left one gets the odd position)."""
    if b.window == 1:
        return b.sum(b.leaf(0), 1)

    def internal(lo: int, hi: int, units: int | None) -> int:
        if hi - lo == 1:
            return b.leaf(lo)
        mid = lo + (hi - lo + 1) // 2
        product = b.product(internal(lo, mid, None), internal(mid, hi, None))
        return b.sum(product, units, identity=identity and units is None)

    return internal(0, b.window, 1)


STRUCTURES: dict[str, Callable[..., int]] = {
    "ff": build_ff,
    "cp": build_cp,
    "hmm": build_hmm,
    "btree": build_btree,
}
"""The builder of each family: the public kinds are ``choices.CIRCUIT_KINDS`` (checked here, at
import); a builder registered later is reachable through :func:`build_structure` only."""
if tuple(STRUCTURES) != CIRCUIT_KINDS:
    raise ImportError(
        f"STRUCTURES {tuple(STRUCTURES)} differ from choices.CIRCUIT_KINDS {CIRCUIT_KINDS}"
    )


def check_kind_window_rank(kind: str, window: int, rank: int) -> None:
    """Raise ValueError for an unknown family, window < 1, rank < 1 or FF with rank != 1."""
    if kind not in STRUCTURES:
        raise ValueError(f"kind must be one of {sorted(STRUCTURES)}, got {kind!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if kind == "ff" and rank != 1:
        raise ValueError(f"rank must be 1 for kind='ff' (use kind='cp' for r > 1), got {rank}")


def build_structure(kind: str, window: int, rank: int, **options: object) -> Structure:
    """The layered structure of a family; ValueError for bad arguments or options."""
    check_kind_window_rank(kind, window, rank)
    b = StructureBuilder(kind, window, rank)
    try:
        root = STRUCTURES[kind](b, **options)
    except TypeError as err:
        raise ValueError(f"invalid options {sorted(options)} for kind={kind!r}: {err}") from err
    return b.finish(root)
