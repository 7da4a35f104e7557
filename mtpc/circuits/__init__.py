"""Contextual tensorised probabilistic circuits in plain torch (no Lightning / Hydra); the
modules: docs/CIRCUITS.md."""

from mtpc.circuits.engine import Circuit
from mtpc.circuits.params import CircuitParams
from mtpc.circuits.structure import STRUCTURES, Structure, StructureBuilder, build_structure

__all__ = [
    "STRUCTURES",
    "Circuit",
    "CircuitParams",
    "Structure",
    "StructureBuilder",
    "build_circuit",
    "build_structure",
]


def build_circuit(kind: str, window: int, rank: int, **options: object) -> Circuit:
    """``Circuit(build_structure(kind, window, rank, **options))``."""
    return Circuit(build_structure(kind, window, rank, **options))
