"""Training in bf16 compute with float32 master weights: ``trainer.precision=bf16-mixed``
(``trainer=gpu``'s default) autocasts the forward, so the head's n·r·V projection and the LoRA
tail multiply in bf16 while every trainable tensor, its gradient and Adam's state stay
float32. On the bundled tiny target (CPU autocast runs the same casts as CUDA's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtpc.backbones import load_backbone
from mtpc.data.datamodule import build_datamodule
from mtpc.model import MTPCModel
from mtpc.training.module import MTPCLightningModule
from tests.helpers import compose_train_cfg

WINDOW, RANK = 4, 4
MATMULS = {"mm", "addmm", "bmm", "linear", "matmul"}


def _module(seed: int = 0) -> MTPCLightningModule:
    torch.manual_seed(seed)
    model = MTPCModel.from_backbone(load_backbone("tiny"), "btree", WINDOW, RANK, lora_layers=1)
    with torch.no_grad():  # peft starts B at zero: random LoRA weights make the tail count
        for p in model.backbone.lora.parameters():
            p.normal_(0, 0.05)
    return MTPCLightningModule(model, chunk_size=64)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    datamodule = build_datamodule(
        source="synthetic", codec="tiny", seq_len=96, window=WINDOW, batch_size=2, num_rows=60,
        cache_dir=str(tmp_path_factory.mktemp("data")),
    )  # fmt: skip
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def _loss_and_grads(
    module: MTPCLightningModule, batch: dict[str, torch.Tensor], bf16: bool
) -> tuple[float, dict[str, torch.Tensor]]:
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = module._objective(batch)[0].loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def test_bf16_compute_gives_the_float32_loss_and_gradients(batch: dict[str, Any]) -> None:
    module = _module()
    loss32, grads32 = _loss_and_grads(module, batch, bf16=False)
    loss16, grads16 = _loss_and_grads(module, batch, bf16=True)
    assert loss16 != loss32  # bf16 did run (else this compares float32 with itself)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32), (loss16, loss32)
    assert sorted(grads16) == sorted(grads32) and len(grads32) > 4  # the head and LoRA
    scale = torch.cat([g.flatten() for g in grads32.values()]).norm()
    for name, g32 in grads32.items():
        g16 = grads16[name]
        assert g16.dtype == torch.float32, name  # gradients of float32 master weights
        # BTree's identity-initialised sums are saturated at step 0: their gradients are ~1e-7
        # of the others', rounding noise in float32 too; every other tensor points the same way
        if g32.norm() > 1e-4 * scale:
            cosine = torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0)
            assert cosine > 0.999, (name, float(cosine))


class _Matmuls(TorchDispatchMode):
    """Records the input dtypes of every matmul by its output's last size."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, set[torch.dtype]]] = []
        self.batched: list[set[torch.dtype]] = []  # bmm: the circuit's sums (B, R, r) @ (B, r, K)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS:
            dtypes = {
                a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()
            }
            self.seen.append((int(out.shape[-1]), dtypes))
            if func.overloadpacket.__name__ == "bmm":
                self.batched.append(dtypes)
        return out


@contextmanager
def _recording() -> Iterator[_Matmuls]:
    with _Matmuls() as mode:
        yield mode


@pytest.mark.parametrize("bf16", [False, True])
def test_the_heads_projection_and_the_lora_tail_multiply_in_the_compute_dtype(
    batch: dict[str, Any], bf16: bool
) -> None:
    """The head's (n·r·V, d) projection is the training step's largest matmul: float32 there
    runs at a fraction of a GPU's bf16 rate. An autocast that changes nothing fails here; so
    does one that reaches the circuit's sums of probabilities (float32 by design)."""
    module = _module()
    vocab = module.head.vocab_size
    with _recording() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as Lightning: the
            loss = module._objective(batch)[0].loss  # forward under autocast, backward after
        loss.backward()
    head = [dtypes for size, dtypes in rec.seen if size == WINDOW * RANK * vocab]
    assert head, rec.seen  # the projection was seen (forward)
    want = torch.bfloat16 if bf16 else torch.float32
    assert all(dtypes == {want} for dtypes in head), head
    rank = next(p for n, p in module.named_parameters() if "lora_A" in n).shape[0]
    lora = [dtypes for size, dtypes in rec.seen if size == rank]  # x @ A^T: (..., rank)
    assert lora and all(dtypes == {want} for dtypes in lora), lora
    assert all(p.dtype == torch.float32 for p in module.model.trainable_parameters())
    # the circuit's sums stay float32 (exact_sums): bf16 keeps 8 bits of each probability
    assert rec.batched and all(dtypes == {torch.float32} for dtypes in rec.batched), rec.batched


def test_the_gpu_trainer_runs_bf16_mixed() -> None:
    """``trainer=gpu`` (and ddp, fsdp on top of it) autocasts: bf16-mixed, not 32-true."""
    for name in ("gpu", "ddp", "fsdp"):
        cfg = compose_train_cfg(Path("/nonexistent"), [f"trainer={name}"])
        assert cfg.trainer.precision == "bf16-mixed", name


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl: Any, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow
def test_lightning_bf16_mixed_keeps_float32_master_weights_and_the_float32_curve(
    tmp_path: Path,
) -> None:
    """Three Lightning steps with ``precision=bf16-mixed`` against ``32-true``: trainable
    tensors and Adam's moments stay float32 and move; the losses agree within 1e-2."""
    curves, states = {}, {}
    for precision in ("32-true", "bf16-mixed"):
        L.seed_everything(0)
        module = _module()
        datamodule = build_datamodule(
            source="synthetic", codec="tiny", seq_len=96, window=WINDOW, batch_size=2,
            num_rows=60, cache_dir=str(tmp_path / "data"),
        )  # fmt: skip
        start = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        losses = _Losses()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, precision=precision, max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
            enable_model_summary=False, callbacks=[losses], default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(module, datamodule=datamodule)
        curves[precision] = losses.losses
        moved = {n: bool((p.detach() != start[n]).any()) for n, p in module.named_parameters()
                 if n in start}  # fmt: skip
        assert all(moved.values()), [n for n, v in moved.items() if not v]
        optimizer = trainer.optimizers[0]
        moments = [s["exp_avg"] for s in optimizer.state.values()]
        states[precision] = {
            "weights": {p.dtype for p in module.model.trainable_parameters()},
            "moments": {m.dtype for m in moments},
        }
    assert states["bf16-mixed"] == {"weights": {torch.float32}, "moments": {torch.float32}}
    assert len(curves["bf16-mixed"]) == 3
    for a, b in zip(curves["bf16-mixed"], curves["32-true"], strict=True):
        assert a != b and abs(a - b) <= 1e-2 * abs(b), curves
