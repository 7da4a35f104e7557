"""One run per folder: the checkpoint to resume, the settings compared on resume, and the
owner's ``.hydra/`` files (kept in ``.mtpc/hydra``, put back when a refused command overwrote
them). See docs/TRAINING.md, "Runs, outputs, resume"."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtpc.draft_fields import FREE_TO_CHANGE, flat_matters
from mtpc.errors import UserError

if TYPE_CHECKING:
    from mtpc.training.settings import TrainerSettings, TrainSettings

log = logging.getLogger(__name__)

CONFIG_KEY = "mtpc_config"  # the settings that wrote a checkpoint (RunRecordCallback)
Resume = tuple[Path, dict[str, Any]]  # a checkpoint's path and contents


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


def find_resume_checkpoint(checkpoint_dir: Path) -> Resume | None:
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
    for other in sorted(set(checkpoint_dir.glob("*.ckpt")) - {last}):
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


def check_resume(
    settings: TrainSettings, run_dir: Path, current: Mapping[str, Any], resume: Resume | None
) -> tuple[dict[str, float], float | None]:
    """Refuses to resume a checkpoint written with other settings (naming the fields and the
    ways out; with ``allow_resume_changes`` a warning; a checkpoint that records none is not
    checked) or with no steps left. Returns the untrained draft's metrics the checkpoint kept
    (empty for a fresh run) and the new learning rate when ``optimizer.lr`` changed (else None)."""
    if resume is None:
        return {}, None
    path, state = resume
    saved, run = state.get(CONFIG_KEY), settings.run
    changes = [] if saved is None else config_changes(saved, current)
    if saved is None:
        log.warning("%s records no config; cannot check the settings of the resumed run", path)
    elif changes and run.allow_resume_changes:
        log.warning(
            "resuming %s with changed settings (allow_resume_changes=true): %s",
            path,
            "; ".join(changes),
        )
    elif changes:
        restore_hydra(run_dir)  # Hydra wrote this command's .hydra/ over the owner's
        # the run_name suffix names edits before new fields
        changed = [c for c in changes if ": (unset) ->" not in c] or changes
        suffix = "-".join(
            f"{c.split(':')[0].rsplit('.', 1)[-1]}{c.rsplit('-> ', 1)[-1].strip(chr(39))}"
            for c in changed[:2]
        )
        raise ResumeConfigError(
            f"the run folder's checkpoint {path} was written with other settings: "
            f"{'; '.join(changes)}. Rerun with the same settings to resume, start a separate "
            f"run with run_name={run.run_name}-{suffix}, or pass allow_resume_changes=true to "
            "resume with the new settings"
        )
    check_steps_left(state, settings.trainer, run_dir)
    lr = settings.sections.lr
    new_lr = float(lr) if any(c.startswith("optimizer.lr:") for c in changes) else None
    return dict(state.get("mtpc_init_metrics") or {}), new_lr


def check_steps_left(state: Mapping[str, Any], trainer: TrainerSettings, run_dir: Path) -> None:
    """Refuses a resume that asks for more steps than its epoch budget lets Lightning take (a
    run that ended at ``trainer.max_epochs`` would silently re-export the same draft)."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    step = int(state.get("global_step", 0))
    if max_steps in (None, -1) or max_epochs in (None, -1) or step >= int(max_steps):
        return
    loops = state.get("loops") or {}
    progress = loops.get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    # an epoch-end checkpoint is written after the epoch counts as processed, before completed
    epochs = max(int(progress.get("completed", 0)), int(progress.get("processed", 0)))
    if epochs >= int(max_epochs):
        raise UserError(
            f"the run in {run_dir} ended at trainer.max_epochs={max_epochs} (step {step}), so "
            f"trainer.max_steps={max_steps} cannot take it further: add trainer.max_epochs=-1 "
            "(then trainer.max_steps alone ends it) to continue it"
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
