"""Checkpoint callbacks: atomic writes (temp file + ``os.replace``, so a kill mid-write keeps
the previous ``last.ckpt``), RNG states and the run's record. See docs/TRAINING.md, "Runs,
outputs, resume"."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves checkpoints through a temporary file and an atomic rename."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


class RNGStateCallback(L.Callback):
    """Saves and restores the global RNG states with each checkpoint, so a resumed run draws
    the same dropout masks and samples as an uninterrupted one."""

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["rng_states"] = {
            "python": random.getstate(),
            # as tensors and plain numbers, so checkpoints load with weights_only=True
            "numpy": (
                str(kind),
                torch.from_numpy(np.asarray(keys)),
                int(pos),
                int(has_gauss),
                float(gauss),
            ),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = checkpoint.get("rng_states")
        if not states:
            return
        random.setstate(states["python"])
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
        torch.set_rng_state(states["torch"])
        if states.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])


class RunRecordCallback(L.Callback):
    """Stores the run's comparable settings and its untrained draft's metrics (read at every
    save, so filled later) in every checkpoint; puts ``new_lr`` (a changed ``optimizer.lr``
    under ``allow_resume_changes=true``) into restored optimizer states."""

    def __init__(
        self, config: dict[str, Any], init_metrics: dict[str, float], new_lr: float | None = None
    ) -> None:
        self.config = config
        self.init_metrics = init_metrics
        self.new_lr = new_lr

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["mtpc_config"] = dict(self.config)
        checkpoint["mtpc_init_metrics"] = dict(self.init_metrics)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.new_lr is None:
            return
        for state in checkpoint.get("optimizer_states", []):
            for group in state.get("param_groups", []):
                group["lr"] = self.new_lr
                if "initial_lr" in group:
                    group["initial_lr"] = self.new_lr
