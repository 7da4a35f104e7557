"""The scale path (issue 26): every circuit under every strategy, fp32 trainable weights,
checkpoints with only what is trained, bounded validation, the GPU self-check's CPU mode.

The two-process runs (``trainer=ddp_cpu`` / ``fsdp_cpu``, gloo) are ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import mtpc
from mtpc.config import ConfigError
from mtpc.heads import MTPCHead
from mtpc.training.module import MTPCLightningModule
from mtpc.training.run import build_trainer
from mtpc.training.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.num_rows=300", "data.seq_len=96", "data.batch_size=2", "loss.chunk_size=128",
         "logger=none", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=2"]  # fmt: skip


def _train_py(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path / name}",
               *SMALL, *overrides]  # fmt: skip
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=overrides)


# -- 1. FF under DDP: no zero-size trainable parameter -----------------------------------------
@pytest.mark.parametrize(("kind", "rank"), [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)])
def test_every_trainable_head_parameter_gets_a_gradient(kind: str, rank: int) -> None:
    """DDP's reducer waits for a gradient of every parameter that requires one; FF's empty
    sum projections never got one ("Expected to have finished reduction" on step 2)."""
    head = MTPCHead(kind, window=3, rank=rank, vocab_size=11, hidden_size=5)
    e = torch.randn(4, 5)  # (B, d)
    x = torch.randint(0, 11, (4, 3))  # (B, n)
    head.chunked_log_likelihood(e, x).sum().backward()
    trainable = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    assert trainable
    assert all(p.numel() > 0 and p.grad is not None for _, p in trainable), [
        n for n, p in trainable if p.grad is None
    ]
    # the exported state keeps every tensor name (drafts exported before load as before)
    assert {"unembedding", "sum_proj", "sum_bias"} <= set(head.state_dict())


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_and_exports_an_ff_draft(tmp_path: Path) -> None:
    result = _train_py(tmp_path, "ff", "trainer=ddp_cpu", "circuit=ff", "trainer.max_steps=3")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "ff" / "metrics.json").read_text())
    assert metrics["train/steps"] == 3 and "val/loss" in metrics
    draft = mtpc.MTPCModel.from_pretrained(tmp_path / "ff" / "draft")
    assert draft.head.kind == "ff"


# -- 2. FSDP: configure_model runs for validate, fit and validate ------------------------------
@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_validates_trains_and_exports(tmp_path: Path) -> None:
    """train() calls validate, fit, validate: each calls configure_model (sharding once)."""
    result = _train_py(
        tmp_path, "fsdp", "trainer=fsdp_cpu", "trainer.max_steps=2",
        "trainer.val_check_interval=1", "circuit.rank=2", "lora.layers=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())
    assert metrics["train/steps"] == 2
    assert "init/val/loss" in metrics and "val/loss" in metrics
    state = torch.load(tmp_path / "fsdp" / "checkpoints" / "last.ckpt", weights_only=False)
    names = sorted(state["state_dict"])
    assert names and all(".head." in k or "lora_" in k for k in names), names[:5]
    draft = mtpc.MTPCModel.from_pretrained(tmp_path / "fsdp" / "draft")
    assert draft.k == 1


def _random_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    from mtpc.data.windows import make_windows

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(64, 320, (2, 24), generator=g)  # (B, L)
    documents = torch.zeros_like(ids)  # (B, L): one document per row
    targets, target_mask, window_mask = make_windows(ids, documents, documents == 0, 3, 0)
    return {"input_ids": ids, "targets": targets, "target_mask": target_mask,
            "window_mask": window_mask, "index": torch.arange(2)}  # fmt: skip


# -- 2 (unit) and 5. FSDP2: shard once; checkpoints gather only what is trained ----------------
@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_once_and_its_checkpoint_gathers_only_trained_weights(
    one_rank_group: None,
) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from mtpc.training.strategy import TrainedOnlyModelParallelStrategy

    model = mtpc.MTPCModel.from_hf(_random_llama(), kind="cp", window=3, rank=2, lora_layers=1)
    module = MTPCLightningModule(model)
    module._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    module.configure_model()
    module.configure_model()  # validate, then fit: the second call must not shard again
    assert any(isinstance(p, DTensor) for p in module.parameters())
    trained = sorted(module.trainable_state_dict())
    assert trained and all(".head." in k or "lora_" in k for k in trained)
    for strategy_class, only_trained in (
        (ModelParallelStrategy, False),  # Lightning's: the whole model, trunk included
        (TrainedOnlyModelParallelStrategy, True),
    ):
        strategy = strategy_class(data_parallel_size=1, tensor_parallel_size=1,
                                  save_distributed_checkpoint=False)  # fmt: skip
        strategy._lightning_module = module
        strategy.model = module
        state = strategy.lightning_module_state_dict()
        params = [k for k in state if k in dict(module.named_parameters())]
        assert (sorted(params) == trained) is only_trained, (strategy_class, len(params))
        if only_trained:
            assert all(
                not isinstance(v, DTensor) and v.device.type == "cpu" for v in state.values()
            )
            for name in trained:
                torch.testing.assert_close(state[name], module.trainable_state_dict()[name]
                                           .full_tensor())  # fmt: skip


def test_fsdp_configs_use_the_trained_only_strategy() -> None:
    from mtpc.training.strategy import TrainedOnlyModelParallelStrategy

    for name in ("fsdp", "fsdp_cpu"):
        cfg = _compose([f"trainer={name}"])
        assert cfg.trainer.strategy._target_ == (
            f"{TrainedOnlyModelParallelStrategy.__module__}.TrainedOnlyModelParallelStrategy"
        )


# -- 3. trainable weights are float32 on a bf16 trunk ------------------------------------------
def test_lora_and_head_train_in_float32_on_a_bf16_trunk() -> None:
    """bf16-mixed keeps no fp32 master copy: bf16 LoRA weights lose Adam's small updates."""
    torch.manual_seed(0)
    model = mtpc.MTPCModel.from_hf(
        _random_llama(torch.bfloat16), kind="btree", window=3, rank=2, lora_layers=1
    )
    module = MTPCLightningModule(
        model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.0), chunk_size=16
    )
    named = dict(module.named_parameters())
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any(".head." in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}, {
        n: p.dtype for n, p in trainable.items() if p.dtype != torch.float32
    }
    assert {p.dtype for n, p in named.items() if n not in trainable} == {torch.bfloat16}
    optimizer = module.configure_optimizers()
    before = {n: p.detach().clone() for n, p in trainable.items()}
    for _ in range(2):  # step 1 moves only LoRA B (it starts at 0); step 2 moves A too
        optimizer.zero_grad()
        loss = module._objective(_batch())[0].loss
        assert torch.isfinite(loss) and loss.dtype == torch.float32
        loss.backward()
        optimizer.step()
    for name, p in trainable.items():
        moved = (p.detach() != before[name]).float().mean().item()
        # measured: bf16 LoRA A (|w| ~ 0.1, update ~1e-4) keeps <1% of its updates
        assert moved > 0.9, (name, moved)


# -- 4. validation is bounded by default on GPU configs and settable ---------------------------
def test_gpu_trainers_bound_validation_and_cpu_keeps_the_whole_split() -> None:
    for name in ("gpu", "ddp", "fsdp"):
        limit = _compose([f"trainer={name}"]).trainer.limit_val_batches
        assert isinstance(limit, int) and 0 < limit <= 200, (name, limit)
    assert _compose(["trainer=cpu"]).trainer.limit_val_batches is None  # embedded default
    assert _compose(["trainer=gpu", "trainer.limit_val_batches=7"]).trainer.limit_val_batches == 7


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "true"])
def test_a_wrong_validation_limit_is_refused_naming_the_field(value: str, tmp_path: Path) -> None:
    cfg = _compose([f"trainer.limit_val_batches={value}", "logger=none"])
    with pytest.raises(ConfigError, match=r"trainer.limit_val_batches=.*allowed: null"):
        build_trainer(TrainSettings.from_cfg(cfg), tmp_path, [])


def test_the_validation_limit_bounds_every_validation(tmp_path: Path) -> None:
    cfg = _compose(["trainer.limit_val_batches=3", "logger=none"])
    assert build_trainer(TrainSettings.from_cfg(cfg), tmp_path, []).limit_val_batches == 3
