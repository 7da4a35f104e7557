"""``trainer=fsdp`` / ``fsdp_cpu``: FSDP2 whose full-state checkpoints gather the trainable
weights only, not the whole model (13 GB for EvaByte) as Lightning's ``ModelParallelStrategy``
does. Loading stays Lightning's (non-strict). See docs/TRAINING.md, "Scale"."""

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
