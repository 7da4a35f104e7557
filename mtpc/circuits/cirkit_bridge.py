"""The same circuits as cirkit (libcirkit 0.3.1) symbolic circuits.

Used to check smoothness and decomposability, to draw structures (``scripts/draw_circuit.py``)
and, in tests, as an oracle: with the same (non-contextual) parameters, cirkit's compiled torch
circuit and our engine agree on log-likelihoods and marginals.

cirkit 0.3.1 has no per-example (contextual) parameters and its sampler does not take
evidence, so the engine in ``mtpc.circuits.engine`` is the hot path; cirkit only sees one
parameter set at a time. The layers map one to one: input fold -> ``CategoricalLayer`` with r
units, product fold -> ``HadamardLayer``, sum fold -> ``SumLayer`` (arity 1).
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
    """Build ``structure`` as a cirkit symbolic circuit.

    Args:
        structure: The layered structure.
        input_probs: Optional fixed categorical probabilities ``(n, r, V)``; None: cirkit's
            default (learnable, softmax-parameterised) categoricals.
        sum_weights: Optional fixed sum weights ``(U, r)`` (rows as in
            ``CircuitParams.sum_logw``, exponentiated); None: cirkit's default weights.
        vocab_size: V when ``input_probs`` is None (default 2).

    Returns:
        A ``cirkit.symbolic.circuit.Circuit`` with one output unit.
    """
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
    for lid, layer in enumerate(structure.layers):
        row: list[Any] = []
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
            if layer.kind != "input":
                in_layers[sl] = [_child(built, structure, slot, f) for slot in layer.slots]
            row.append(sl)
        built.append(row)
        del lid
    layers = [sl for row in built for sl in row]
    return SymbolicCircuit(layers, in_layers, [built[-1][0]])


def _child(built: list[list[Any]], structure: Structure, slot: Any, fold: int) -> Any:
    for src, pos, child in slot.parts:
        hits = (pos == fold).nonzero()
        if hits.numel():
            return built[src][int(child[int(hits[0, 0])])]
    raise AssertionError("fold without child")


def _np(t: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, Tensor):
        return t.detach().cpu().double().numpy()
    return np.asarray(t, dtype=np.float64)


def check_structural_properties(structure: Structure) -> dict[str, bool]:
    """Smoothness and decomposability of ``structure`` as checked by cirkit."""
    sc = to_cirkit(structure)
    return {"smooth": bool(sc.is_smooth), "decomposable": bool(sc.is_decomposable)}
