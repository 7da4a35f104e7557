"""MTPC: multi-token prediction draft heads as probabilistic circuits (docs/DESIGN.md).

The public names are resolved lazily, so ``import mtpc`` stays cheap and the circuit math can
be used without the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "MTPCHead": "mtpc.heads",
    "MTPCModel": "mtpc.model",
    "generate": "mtpc.decoding",
    "generate_hetero": "mtpc.decoding.hetero",
    "get_codec": "mtpc.backbones.codecs",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mtpc' has no attribute {name!r}")
