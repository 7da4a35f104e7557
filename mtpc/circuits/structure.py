"""Layered ("folded") circuit structures and the builders of the four MTPC families. Index
tensors are computed once, here, at build time. A family is a builder that creates nodes with
:class:`StructureBuilder` and returns the root; ``STRUCTURES`` is their registry. See
docs/CIRCUITS.md, "Structures" and "Adding a structure"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
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
        self._check_tree(root)
        where: dict[int, tuple[int, int]] = {i: (0, i) for i in range(n)}  # node -> (layer, fold)
        layers = [Layer("input", n, self.rank, (), None, 0, tuple((i,) for i in range(n)))]
        tie: list[int] = []  # Structure.sum_tie, one entry per sum unit
        param_rows: list[tuple[_Node, int]] = []  # (node, output unit) of each parameter row
        first_row: dict[Hashable, int] = {}  # the first parameter row of each tie key
        for (_, kind, arity, units), members in self._groups():
            lid = len(layers)
            for f, v in enumerate(members):
                where[v] = (lid, f)
            children = [self.nodes[v].children for v in members]
            slots = tuple(
                _make_slot([where[ch[a]] for ch in children], layers) for a in range(arity)
            )
            flat = [where[c] for ch in children for c in ch]  # fold-major: f * A + a
            view_start = _run_start(flat) if kind == "product" else None
            offset = len(tie) if kind == "sum" else 0  # sums: one row per unit, fold-major
            if kind == "sum":
                for v in members:
                    nd = self.nodes[v]
                    if nd.identity and units != self.rank:
                        raise ValueError("identity-initialised sums need r output units")
                    key = ("node", v) if nd.tie is None else ("tie", nd.tie)
                    if key not in first_row:  # tied sums share one node's parameter rows
                        first_row[key] = len(param_rows)
                        param_rows += [(nd, j) for j in range(units)]
                    tie.extend(range(first_row[key], first_row[key] + units))
            scopes = tuple(self.nodes[v].scope for v in members)
            layers.append(Layer(kind, len(members), units, slots, view_start, offset, scopes))  # type: ignore[arg-type]
        if where[root] != (len(layers) - 1, 0) or layers[-1].num_folds != 1:
            raise ValueError("the root must be alone in the last layer")
        return Structure(
            kind=self.kind,
            window=n,
            rank=self.rank,
            layers=tuple(layers),
            num_sum_rows=len(tie),
            sum_tie=torch.tensor(tie, dtype=torch.long),
            num_param_rows=len(param_rows),
            param_unit=torch.tensor([j for _, j in param_rows], dtype=torch.long),
            param_identity=torch.tensor([nd.identity for nd, _ in param_rows], dtype=torch.bool),
            param_contextual=torch.tensor(
                [nd.contextual for nd, _ in param_rows], dtype=torch.bool
            ),
        )

    def _check_tree(self, root: int) -> None:
        """Check the root, the tree shape and the children's units."""
        nodes = self.nodes
        if nodes[root].scope != tuple(range(self.window)):
            raise ValueError("the root must depend on every window position")
        if nodes[root].units != 1:
            raise ValueError("the root must have exactly one unit")
        # Tree shape: every node but the root has one parent (children are created before
        # their parents: a node outside the root's tree leaves one without a parent).
        uses = Counter(c for nd in nodes for c in nd.children)
        if any(uses[v] != (0 if v == root else 1) for v in range(len(nodes))):
            raise ValueError("every node must have exactly one parent (tree-shaped circuit)")
        for nd in nodes:
            if nd.kind == "product" and any(nodes[c].units != self.rank for c in nd.children):
                raise ValueError("product children must all have r units")
            if nd.kind == "sum" and nodes[nd.children[0]].units != self.rank:
                raise ValueError("sum children must have r units")

    def _groups(self) -> list[tuple[tuple[int, str, int, int], list[int]]]:
        """The inner nodes grouped into layers: ``((height, kind, arity, units), members)`` in
        layer order (by height, products first), members ordered by their first position."""
        nodes = self.nodes
        height: list[int] = []  # inputs 0; children are always created before parents
        for nd in nodes:
            height.append(1 + max((height[c] for c in nd.children), default=-1))
        groups: dict[tuple[int, str, int, int], list[int]] = {}
        for v, nd in enumerate(nodes[self.window :], self.window):
            groups.setdefault((height[v], nd.kind, len(nd.children), nd.units), []).append(v)
        keys = sorted(groups, key=lambda k: (k[0], k[1] != "product", k[2], k[3]))
        return [(k, sorted(groups[k], key=lambda v: nodes[v].scope[0])) for k in keys]


def _make_slot(children: list[tuple[int, int]], layers: list[Layer]) -> Slot:
    sources = tuple(sorted({lid for lid, _ in children}))
    # each source's first fold in the concatenation of the sources
    first = {s: sum(layers[t].num_folds for t in sources[:i]) for i, s in enumerate(sources)}
    index = torch.tensor([first[lid] + f for lid, f in children], dtype=torch.long)  # (F,)
    return Slot(sources, index, _run_start(children))


def _run_start(children: list[tuple[int, int]]) -> int | None:
    """The first fold when ``children`` (layer, fold) are consecutive folds of one layer."""
    folds = [f for _, f in children]
    run = folds == list(range(folds[0], folds[0] + len(folds)))
    return folds[0] if run and len({lid for lid, _ in children}) == 1 else None


def build_ff(b: StructureBuilder) -> int:
    """FF: the n input distributions under one product (rank 1)."""
    return b.product(*(b.leaf(i) for i in range(b.window)))


def build_cp(b: StructureBuilder) -> int:
    """CP: r fully factorised components (one product of r units) under one sum."""
    return b.sum(build_ff(b), 1)


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
    for name, val in (("window", window), ("rank", rank)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
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
