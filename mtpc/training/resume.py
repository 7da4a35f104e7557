"""One run per folder: the checkpoint to resume, the settings compared on resume, and the
owner's ``.hydra/`` files (kept in ``.mtpc/hydra``, put back when a refused command overwrote
them). See docs/TRAINING.md, "Runs, outputs, resume"."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mtpc.draft_fields import FREE_TO_CHANGE, flat_matters
from mtpc.errors import UserError

log = logging.getLogger(__name__)

CONFIG_KEY = "mtpc_config"  # the settings that wrote a checkpoint (RunRecordCallback)


class RunFolderBusyError(UserError):
    """Another run holds the run folder's lock."""


class ResumeConfigError(UserError):
    """The run folder's checkpoint was written with settings that differ from the config's."""


class CheckpointUnreadableError(UserError):
    """No checkpoint of the run folder can be read."""


def is_global_zero() -> bool:
    """Whether this process is global rank 0 (from the launcher's environment variables)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value) == 0
    return True


def _read_checkpoint(path: Path) -> dict[str, Any]:
    # memory-mapped: checks the archive without reading the tensors
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("not a Lightning checkpoint (no state_dict)")
    return checkpoint


def find_resume_checkpoint(checkpoint_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its contents, or None when the folder has none:
    ``last.ckpt``, else the readable one with the highest global step (a warning; every rank
    chooses the same). :class:`CheckpointUnreadableError` when none can be read."""
    last = checkpoint_dir / "last.ckpt"
    if not last.exists():
        return None
    try:
        return last, _read_checkpoint(last)
    except Exception as err:  # truncated archive, garbage, wrong format
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    readable: list[tuple[int, Path, dict[str, Any]]] = []
    for other in sorted(checkpoint_dir.glob("*.ckpt")):
        if other == last:
            continue
        try:
            checkpoint = _read_checkpoint(other)
        except Exception:
            continue
        readable.append((int(checkpoint.get("global_step", -1)), other, checkpoint))
    if not readable:
        raise CheckpointUnreadableError(
            f"cannot resume: {last} is unreadable ({reason}) and no other checkpoint in "
            f"{checkpoint_dir} is readable; delete {last} to start the run over"
        )
    step, path, checkpoint = max(readable, key=lambda item: (item[0], item[1].name))
    log.warning(
        "%s is unreadable (%s); resuming from %s (global step %d) instead", last, reason, path, step
    )
    return path, checkpoint


def comparable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that must match on resume, flattened to ``{dotted field: value}``, from
    the whole config as plain values (``TrainSettings.resolved``)."""
    flat = flat_matters(config)
    return {k: v for k, v in flat.items() if not k.startswith(FREE_TO_CHANGE)}


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``field: saved -> current`` for every setting that differs (both already comparable)."""
    missing = object()
    changes = []
    for field in sorted(set(saved) | set(current)):
        old, new = saved.get(field, missing), current.get(field, missing)
        if old != new:
            show = ["(unset)" if v is missing else repr(v) for v in (old, new)]
            changes.append(f"{field}: {show[0]} -> {show[1]}")
    return changes


def check_resume_config(
    checkpoint_path: Path,
    saved: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    run_name: str,
    allow: bool,
) -> list[str]:
    """Refuses to resume a checkpoint written with other settings (``saved``; None: written
    before configs were stored), naming the fields and the ways out, unless ``allow`` (then a
    warning). Returns the changes."""
    if saved is None:
        log.warning(
            "%s records no config; cannot check the settings of the resumed run", checkpoint_path
        )
        return []
    changes = config_changes(saved, current)
    if not changes:
        return []
    if allow:
        log.warning(
            "resuming %s with changed settings (allow_resume_changes=true): %s",
            checkpoint_path,
            "; ".join(changes),
        )
        return changes
    changed = [c for c in changes if ": (unset) ->" not in c] or changes  # edits before new fields
    suffix = "-".join(
        f"{c.split(':')[0].rsplit('.', 1)[-1]}{c.rsplit('-> ', 1)[-1].strip(chr(39))}"
        for c in changed[:2]
    )
    raise ResumeConfigError(
        f"the run folder's checkpoint {checkpoint_path} was written with other settings: "
        f"{'; '.join(changes)}. Rerun with the same settings to resume, start a separate run "
        f"with run_name={run_name}-{suffix}, or pass allow_resume_changes=true to resume "
        "with the new settings"
    )


def snapshot_hydra(run_dir: Path) -> None:
    """Keeps a copy of ``.hydra/`` of the run that owns the folder in ``.mtpc/hydra``."""
    hydra = run_dir / ".hydra"
    if hydra.is_dir():
        keep = run_dir / ".mtpc" / "hydra"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(hydra, keep)


def restore_hydra(run_dir: Path) -> None:
    """Puts back the owner's ``.hydra/`` after a refused command overwrote it."""
    keep = run_dir / ".mtpc" / "hydra"
    if keep.is_dir():
        for file in keep.iterdir():
            shutil.copy2(file, run_dir / ".hydra" / file.name)
