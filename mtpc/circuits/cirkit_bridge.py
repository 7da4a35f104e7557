"""The same circuits as cirkit (libcirkit 0.3.1) symbolic circuits: structural checks,
drawing and the tests' oracle, one parameter set at a time. See docs/CIRCUITS.md, "cirkit".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from mtpc.circuits.structure import Structure


def to_cirkit(
    structure: Structure,
    input_probs: Tensor | np.ndarray | None = None,
    sum_weights: Tensor | np.ndarray | None = None,
    vocab_size: int | None = None,
) -> Any:
    """Build ``structure`` as a cirkit symbolic circuit with one output unit.
    ``input_probs`` ``(n, r, V)`` and ``sum_weights`` ``(U, r)`` (rows as in
    ``CircuitParams.sum_logw``, exponentiated) fix the parameters; None: cirkit's defaults.
    ``vocab_size``: V when ``input_probs`` is None (default 2)."""
    from cirkit.symbolic.circuit import Circuit as SymbolicCircuit
    from cirkit.symbolic.initializers import ConstantTensorInitializer
    from cirkit.symbolic.layers import CategoricalLayer, HadamardLayer, SumLayer
    from cirkit.symbolic.parameters import Parameter, TensorParameter
    from cirkit.utils.scope import Scope

    n, r = structure.window, structure.rank

    def const(arr: np.ndarray) -> Any:
        init = ConstantTensorInitializer(np.ascontiguousarray(arr))
        return Parameter.from_input(TensorParameter(*arr.shape, initializer=init, learnable=False))

    probs = None if input_probs is None else _np(input_probs)
    weights = None if sum_weights is None else _np(sum_weights)
    if probs is not None:
        if probs.shape[:2] != (n, r):
            raise ValueError(f"input_probs must have shape (n={n}, r={r}, V), got {probs.shape}")
        vocab_size = probs.shape[2]
    if weights is not None and weights.shape != (structure.num_sum_rows, r):
        raise ValueError(
            f"sum_weights must have shape (U={structure.num_sum_rows}, r={r}), got {weights.shape}"
        )
    V = vocab_size or 2

    built: list[list[Any]] = []
    in_layers: dict[Any, list[Any]] = {}
    for layer in structure.layers:
        row: list[Any] = []
        # each slot's children: slot.index counts in the concatenation of its source layers
        kids = [[c for src in slot.sources for c in built[src]] for slot in layer.slots]
        for f in range(layer.num_folds):
            if layer.kind == "input":
                kw = {} if probs is None else {"probs": const(probs[f])}
                sl = CategoricalLayer(Scope([f]), r, num_categories=V, **kw)
            elif layer.kind == "product":
                sl = HadamardLayer(r, arity=layer.arity)
            else:
                R = layer.num_units
                lo = layer.sum_offset + f * R
                kw = {} if weights is None else {"weight": const(weights[lo : lo + R])}
                sl = SumLayer(r, R, arity=1, **kw)
            for slot, children in zip(layer.slots, kids, strict=True):
                in_layers.setdefault(sl, []).append(children[int(slot.index[f])])
            row.append(sl)
        built.append(row)
    layers = [sl for row in built for sl in row]
    return SymbolicCircuit(layers, in_layers, [built[-1][0]])


def _np(t: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, Tensor):
        return t.detach().cpu().double().numpy()
    return np.asarray(t, dtype=np.float64)


def check_structural_properties(structure: Structure) -> dict[str, bool]:
    """Smoothness and decomposability of ``structure`` as checked by cirkit."""
    sc = to_cirkit(structure)
    return {"smooth": bool(sc.is_smooth), "decomposable": bool(sc.is_decomposable)}
