"""``MTPCLightningModule``: trains an MTPC draft's head (and LoRA tail for k > 0); only these
are checkpointed. The logged metrics: docs/TRAINING.md, "Objective"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from torch import Tensor

from mtpc.circuits.params import exact_sums
from mtpc.heads import MTPCHead
from mtpc.model import MTPCModel
from mtpc.training.loss import LossOutput, composite_nll, distillation_kl, expected_accepted

TOP1_POSITIONS = 512  # positions per validation batch for the top-1 metric


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the batch."""


class MTPCLightningModule(L.LightningModule):
    """Lightning wrapper around an :class:`MTPCModel` and the MTPC losses; ``optimizer`` and
    ``scheduler``: partials of the trainable parameters and the optimizer (None: Adam at 3e-4,
    no scheduler)."""

    def __init__(
        self,
        model: MTPCModel,
        loss: str = "nll",
        gamma: float | None = None,
        normalise_discount: bool = False,
        chunk_size: int = 1024,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_name = loss
        self.gamma = gamma
        self.normalise_discount = normalise_discount
        self.chunk_size = chunk_size
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.strict_loading = False  # checkpoints hold only the trainable weights
        upcast_trainable(model)

    @property
    def head(self) -> MTPCHead:
        return self.model.head

    def _objective(self, batch: Mapping[str, Tensor]) -> tuple[LossOutput, Tensor, Tensor]:
        """The loss, the windows' prefix log-probs (B, L, n) and the draft features (B, L, d)."""
        out = self.model(
            batch["input_ids"],
            return_verifier_logits=self.loss_name == "kl",
            positions=batch.get("position_ids"),  # restart at every packed document
            documents=batch.get("document_ids"),  # attention stays inside a document
        )
        features = out.draft_features  # (B, L, d)
        B, L, d = features.shape
        n = self.head.window
        flat = features.reshape(B * L, d)
        targets = batch["targets"].reshape(B * L, n)
        in_document = batch["window_mask"].reshape(B * L, n)
        prefix = self.head.chunked_log_likelihood(
            flat, targets, in_document, chunk_size=self.chunk_size
        ).reshape(B, L, n)
        mask = batch["target_mask"]
        if self.loss_name == "nll":
            result = composite_nll(prefix, mask, self.gamma, self.normalise_discount)
        else:
            teacher = self._teacher_log_probs(out.verifier_logits)
            draft = self._conditionals(flat, targets).reshape(B, L, n, -1)
            result = distillation_kl(teacher, draft, mask, self.gamma, self.normalise_discount)
        return result, prefix, features

    def _teacher_log_probs(self, verifier_logits: Tensor) -> Tensor:
        """The target's next-byte log-probs for window position j of every t; (B, L, n, V).
        The byte x_{t+j} is predicted by the target at position t+j-1."""
        n = self.head.window
        log_p = torch.log_softmax(verifier_logits.float(), dim=-1)  # (B, L, V)
        padded = torch.nn.functional.pad(log_p, (0, 0, 0, n - 1))  # (B, L+n-1, V)
        return padded.unfold(1, n, 1).permute(0, 1, 3, 2)  # (B, L, n, V)

    def _conditionals(self, features: Tensor, targets: Tensor) -> Tensor:
        """log q(. | the first j targets) for j = 0..n-1, ``chunk_size`` rows at a time;
        (R, n, V) for ``features`` (R, d) and ``targets`` (R, n)."""
        circuit, n, step = self.head.circuit, self.head.window, self.chunk_size
        rows = []
        for i in range(0, len(features), step):
            params = self.head(features[i : i + step])
            chunk = targets[i : i + step]  # (C, n)
            with exact_sums(targets.device):  # the circuit in float32 under bf16-mixed
                per_position = [
                    circuit.conditional_log_prob(params, chunk[:, :j]) for j in range(n)
                ]
            rows.append(torch.stack(per_position, dim=1))  # (C, n, V)
        return torch.cat(rows)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        result, _, _ = self._objective(batch)
        if not torch.isfinite(result.loss):
            raise NonFiniteLossError(
                f"non-finite training loss {result.loss.item()} at global step "
                f"{self.global_step}, epoch {self.current_epoch}, batch {batch_idx} "
                f"(packed sequences {batch['index'].tolist()}); the last good checkpoint is kept"
            )
        self._log_losses("train", result, batch)
        return result.loss

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        result, prefix, features = self._objective(batch)
        self._log_losses("val", result, batch)
        batch_size = batch["input_ids"].shape[0]
        accepted = expected_accepted(prefix, batch["target_mask"])
        self.log("val/expected_accepted", accepted, batch_size=batch_size, sync_dist=True)
        for j, accuracy in enumerate(self._top1(features, batch), start=1):
            self.log(f"val/top1_{j}", accuracy, batch_size=batch_size, sync_dist=True)

    def _log_losses(self, stage: str, result: LossOutput, batch: Mapping[str, Tensor]) -> None:
        size = batch["input_ids"].shape[0]
        self.log(f"{stage}/loss", result.loss.detach(), batch_size=size, prog_bar=True,
                 on_step=stage == "train", on_epoch=True, sync_dist=True)  # fmt: skip
        for j, value in enumerate(result.per_position, start=1):
            self.log(f"{stage}/loss_{j}", value, batch_size=size, on_step=False, on_epoch=True,
                     sync_dist=True)  # fmt: skip

    @torch.no_grad()
    def _top1(self, features: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
        """Per-position top-1 agreement of the draft's conditionals with the data; (n,)."""
        n = self.head.window
        mask = batch["target_mask"].reshape(-1, n)
        rows = mask.any(dim=1).nonzero().squeeze(1)[:TOP1_POSITIONS]
        if rows.numel() == 0:
            return features.new_zeros(n)
        flat = features.reshape(-1, features.shape[-1])[rows]
        targets = batch["targets"].reshape(-1, n)[rows]
        log_q = self._conditionals(flat, targets)  # (R, n, V)
        valid = mask[rows]
        hits = ((log_q.argmax(dim=-1) == targets) & valid).sum(dim=0)
        return hits.float() / valid.sum(dim=0).clamp(min=1).float()

    def configure_optimizers(self) -> Any:
        factory = self.optimizer_factory or (lambda p: torch.optim.Adam(p, lr=3e-4))
        optimizer = factory(self.model.trainable_parameters())
        if self.scheduler_factory is None:
            return optimizer
        lr_scheduler = {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler}

    def gathered_trainable_state(self) -> dict[str, Tensor]:
        """The trainable weights as whole tensors on CPU, for a checkpoint or an export.
        Collective under FSDP2 (rank 0 gets the tensors, the others ``{}``); the frozen trunk
        is dropped *before* the gather."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
        )
        state = get_model_state_dict(self, options=options)
        return {name: value for name, value in state.items() if isinstance(value, Tensor)}

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """State of the trainable weights only (head + LoRA), by module path."""
        trainable = {id(p) for p in self.model.trainable_parameters()}
        return {n: p.detach() for n, p in self.named_parameters() if id(p) in trainable}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # FSDP2: the trainable entries of the full state dict the strategy gathered on rank 0
        full = checkpoint.get("state_dict") or {}
        checkpoint["state_dict"] = {
            name: full.get(name, value) for name, value in self.trainable_state_dict().items()
        }

    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``, a no-op otherwise: each decoder layer a unit,
        the draft model the root (its parameters stay gathered from forward to backward, for the
        chunked likelihood). Shards on the first call only. See docs/TRAINING.md, "Scale"."""
        mesh = self.device_mesh  # set by ModelParallelStrategy, None otherwise
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):  # sharded by an earlier validate / fit
            return
        data_parallel = mesh["data_parallel"]
        for layer in self.model.backbone.layers:
            fully_shard(layer, mesh=data_parallel)
        fully_shard(self.model, mesh=data_parallel)


def upcast_trainable(model: MTPCModel) -> None:
    """Makes every trainable tensor (head and LoRA) float32: Adam's small updates to bf16
    weights round away (docs/TRAINING.md, "What is trained")."""
    for param in model.trainable_parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
