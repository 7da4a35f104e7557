"""``trainer=fsdp`` / ``fsdp_cpu``: FSDP2 whose checkpoints gather only what is trained.

Lightning's ``ModelParallelStrategy`` with ``save_distributed_checkpoint: false`` gathers the
whole model on rank 0 at every save (``get_model_state_dict(full_state_dict=True)``): for
EvaByte the 13 GB frozen trunk, all-gathered and copied to CPU, then dropped by
``MTPCLightningModule.on_save_checkpoint``. :class:`TrainedOnlyModelParallelStrategy`
gathers the trainable weights only (``MTPCLightningModule.gathered_trainable_state``); the
optimizer state holds only those weights anyway. Loading is Lightning's: a checkpoint's
state dict is loaded non-strictly (``strict_loading = False``), so ``last.ckpt`` resumes.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override


class TrainedOnlyModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose full-state checkpoints hold the trainable weights only."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from mtpc.training.module import MTPCLightningModule

        module = self.lightning_module
        if self._save_distributed_checkpoint or not isinstance(module, MTPCLightningModule):
            return super().lightning_module_state_dict()
        return module.gathered_trainable_state()  # rank 0: {name: tensor}; others: {}
