"""Which fields of a training config shape the trained draft (plain data; no mtpc imports).

Shared by training's resume check (``mtpc/training/resume.py``: a resumed run must match
them) and the evaluation's merge over training seeds (``mtpc/evaluation/statistics.py``:
drafts whose configurations differ only in these free fields and the seed are merged).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# top-level config keys whose values shape the trained draft
MATTERS = (
    "model", "circuit", "lora", "loss", "optimizer", "scheduler", "data", "seed", "stage",
    "init_from", "global_batch_size", "trainer",
)  # fmt: skip

# dotted fields that may differ on resume (budget, hardware, logging)
FREE_TO_CHANGE = (
    "data.num_workers", "data.cache_dir", "data.pin_memory", "model.device",
    "trainer.max_steps", "trainer.max_epochs", "trainer.max_time",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
    "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch", "trainer.limit_val_batches",
    "trainer.num_sanity_val_steps", "trainer.deterministic", "trainer.fast_dev_run",
)  # fmt: skip


def flat_matters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`MATTERS` sections of ``config`` (plain values) flattened to ``{dotted field:
    value}`` (a non-empty mapping is opened; anything else, an empty mapping included, is a
    value; lists and tuples become lists). Each caller drops its own free fields."""
    flat: dict[str, Any] = {}
    for key in MATTERS:
        if key in config:
            _flatten(config[key], key, flat)
    return flat


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = list(value) if isinstance(value, list | tuple) else value
