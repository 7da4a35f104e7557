"""Training: the Lightning module learns, train(cfg) runs both stages, resumes, exports.

End-to-end runs use the bundled tiny target with a few hundred synthetic rows, short packed
sequences and a handful of steps, so the whole file runs in about a minute on 2 cores.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from mtpc.config import ConfigError
from mtpc.data.datamodule import build_datamodule
from mtpc.model import MTPCModel
from mtpc.training.module import MTPCLightningModule, NonFiniteLossError
from mtpc.training.run import build_model, train
from mtpc.training.settings import TrainSettings
from tests.helpers import compose_train_cfg, require_extra

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
FAST = [
    "data.num_rows=300",
    "data.seq_len=96",
    "data.batch_size=4",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.limit_val_batches=2",
    "loss.chunk_size=128",
]


def _compose(
    tmp_path: Path, overrides: list[str], name: str = "run", fast: list[str] = FAST
) -> DictConfig:
    """The training config of ``fast + overrides``, writing only under ``tmp_path``."""
    return compose_train_cfg(tmp_path, overrides, name, fast=fast)


def _random_llama(vocab: int = 320) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def _optimise(module: MTPCLightningModule, batch: dict, steps: int) -> list[float]:
    """Plain optimizer steps on one batch; the loss after each."""
    optimizer = module.configure_optimizers()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module._objective(batch)[0].loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("kind", "rank"), [("ff", 1), ("cp", 3), ("hmm", 3), ("btree", 3)])
def test_loss_decreases_when_overfitting_one_batch(kind: str, rank: int, tmp_path: Path) -> None:
    model = MTPCModel.from_hf(_random_llama(), kind=kind, window=4, rank=rank, lora_layers=0)
    datamodule = build_datamodule(
        source="synthetic", codec="tiny", seq_len=64, window=4, batch_size=2, num_rows=200,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    module = MTPCLightningModule(
        model, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), chunk_size=64
    )
    losses = _optimise(module, batch, steps=15)
    assert losses[-1] < 0.8 * losses[0], losses


def test_only_head_and_lora_weights_train_and_are_checkpointed() -> None:
    model = MTPCModel.from_hf(_random_llama(), kind="btree", window=4, rank=2, lora_layers=1)
    module = MTPCLightningModule(model)
    state = module.trainable_state_dict()
    assert state and all(".head." in k or "lora_" in k for k in state)
    frozen = [n for n, p in module.named_parameters() if n not in state]
    assert frozen and not any(p.requires_grad for n, p in module.named_parameters() if n in frozen)


def test_non_finite_loss_names_step_and_batch(tmp_path: Path) -> None:
    model = MTPCModel.from_hf(_random_llama(), kind="cp", window=4, rank=2, lora_layers=0)
    with torch.no_grad():
        model.head.unembedding.fill_(float("nan"))
    datamodule = build_datamodule(
        source="synthetic", codec="tiny", seq_len=64, window=4, batch_size=2, num_rows=200,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, limit_val_batches=0,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"global step 0, epoch 0, batch 0"):
        trainer.fit(MTPCLightningModule(model), datamodule=datamodule)


def _read_losses(run_dir: Path) -> dict[int, float]:
    """train/loss_step per global step from the CSV logger."""
    losses: dict[int, float] = {}
    for metrics in sorted(run_dir.rglob("metrics.csv")):
        with metrics.open() as handle:
            for row in csv.DictReader(handle):
                if row.get("train/loss_step"):
                    losses[int(row["step"])] = float(row["train/loss_step"])
    return losses


def test_optimisation_options_reach_the_loss_and_the_optimizer(tmp_path: Path) -> None:
    """loss.normalise_discount, optimizer.betas and optimizer.weight_decay are not ignored."""
    common = ["circuit=cp", "circuit.window=3", "circuit.rank=2", "trainer.max_steps=1"]
    plain = train(_compose(tmp_path, common, "plain"))
    tuned = train(
        _compose(
            tmp_path,
            [*common, "loss.normalise_discount=true", "optimizer.betas=[0.8,0.95]",
             "optimizer.weight_decay=0.1"],
            "tuned",
        )
    )  # fmt: skip
    weights = sum(0.8**j for j in range(3))  # gamma = 0.8 for n <= 8
    assert tuned["init/val/loss"] == pytest.approx(plain["init/val/loss"] / weights, rel=1e-5)
    state = torch.load(tmp_path / "tuned" / "checkpoints" / "last.ckpt", weights_only=False)
    group = state["optimizer_states"][0]["param_groups"][0]
    assert tuple(group["betas"]) == (0.8, 0.95) and group["weight_decay"] == 0.1


def test_two_stage_training_exports_and_beats_the_untrained_head(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, ["circuit=btree", "circuit.window=4", "circuit.rank=4",
                              "trainer.max_steps=12", "+circuit.head_init=stp"], "heads")  # fmt: skip
    # head_init=stp: position 1 starts from the next-byte unembedding, the rest at random,
    # far from the data, so a dozen steps must show (the default init is the target's MTP heads)
    metrics = train(cfg)
    draft = tmp_path / "heads" / "draft"
    assert (draft / "config.json").exists() and (draft / "head.safetensors").exists()
    assert metrics["val/loss"] < metrics["init/val/loss"]
    assert (tmp_path / "heads" / "checkpoints" / "last.ckpt").exists()
    assert json.loads((tmp_path / "heads" / "metrics.json").read_text())["train/steps"] == 12
    assert (tmp_path / "outputs" / "last_draft.txt").read_text().strip() == str(draft.resolve())

    lora = _compose(tmp_path, ["circuit=btree", "circuit.window=4", "circuit.rank=4",
                               "trainer.max_steps=3", "stage=lora", "lora.layers=1",
                               f"init_from={draft}"], "lora")  # fmt: skip
    lora_metrics = train(lora)
    # stage 2 starts from stage 1's head: its untrained loss is stage 1's final loss
    assert lora_metrics["init/val/loss"] == pytest.approx(metrics["val/loss"], rel=1e-4)
    exported = json.loads((tmp_path / "lora" / "draft" / "config.json").read_text())
    assert exported["lora"]["layers"] == 1


@pytest.mark.parametrize("source_layers", [1, 2])
def test_init_from_a_lora_draft_loads_its_lora_weights(tmp_path: Path, source_layers: int) -> None:
    """A LoRA-stage draft (k = 1, or k = 2 into k = 1: the names that match) initialises a
    k = 1 LoRA stage: its LoRA weights arrive, not only its head."""
    from mtpc.training.run import load_initial_weights
    from tests.fakes import make_model

    source = make_model("cp", 4, 2, k=source_layers)
    draft = source.save_pretrained(tmp_path / "draft")
    target = make_model("cp", 4, 2, k=1)
    with torch.no_grad():
        for p in target.backbone.lora.parameters():
            p.zero_()
    load_initial_weights(target, draft)
    theirs = source.backbone.lora.state_dict()
    ours = target.backbone.lora.state_dict()
    shared = [name for name in ours if name in theirs]
    assert shared  # the last layer's names are shared by k = 1 and k = 2
    for name in shared:
        assert torch.equal(ours[name], theirs[name]), name
    heads = target.head.state_dict(), source.head.state_dict()
    assert all(torch.equal(value, heads[1][name]) for name, value in heads[0].items())


def test_init_from_a_different_circuit_is_refused(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, ["circuit=cp", "circuit.window=4", "circuit.rank=2",
                              "trainer.max_steps=1", "validate_before_training=false"], "a")  # fmt: skip
    train(cfg)
    other = _compose(tmp_path, ["circuit=cp", "circuit.window=4", "circuit.rank=3",
                                "stage=lora", f"init_from={tmp_path / 'a' / 'draft'}"], "b")  # fmt: skip
    with pytest.raises(ConfigError, match=r"circuit\.rank"):
        train(other)
    missing = _compose(tmp_path, ["stage=lora", f"init_from={tmp_path / 'nope'}"], "c")
    with pytest.raises(ConfigError, match="does not exist"):
        train(missing)


def test_resume_continues_the_same_loss_curve(tmp_path: Path) -> None:
    common = ["circuit=cp", "circuit.window=4", "circuit.rank=2", "validate_before_training=false",
              "callbacks.checkpoint_every_n_steps=1", "export=false"]  # fmt: skip
    train(_compose(tmp_path, [*common, "trainer.max_steps=6"], "straight"))
    straight = _read_losses(tmp_path / "straight")
    # an interrupted run: killed after step 3 (last.ckpt at step 3), then the same command
    train(_compose(tmp_path, [*common, "trainer.max_steps=3"], "resumed"))
    train(_compose(tmp_path, [*common, "trainer.max_steps=6"], "resumed"))
    resumed = _read_losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(6))
    for step in range(6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


@pytest.mark.slow
def test_every_experiment_composes_and_validates() -> None:
    from mtpc.training.settings import validate_train_config

    experiments = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    assert len(experiments) >= 40
    for name in experiments:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={name}"])
        validate_train_config(cfg)
        assert cfg.run_name == name and cfg.global_batch_size == 256
        assert (cfg.stage == "lora") == ("_lora" in name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    sorted({p.stem.split("_lora")[0] for p in (CONFIG_DIR / "experiment").glob("evabyte_*")}
           | {p.stem for p in (CONFIG_DIR / "experiment").glob("evabyte_*_lora4.yaml")}),
)  # fmt: skip
def test_experiment_runs_fast_dev_run_on_the_tiny_target(name: str, tmp_path: Path) -> None:
    """Each experiment's circuit and LoRA depth, on the tiny target instead of the hub model.

    The llama3_byte experiments share these circuits and depths, so they are covered too.
    """
    cfg = _compose(tmp_path, [f"experiment={name}", "model=tiny", "data=synthetic",
                              "trainer=cpu", "logger=none", "trainer.fast_dev_run=true",
                              "stage=heads", "init_from=null", "global_batch_size=null"])  # fmt: skip
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss_step"])


def test_wandb_offline_writes_a_run(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, ["logger=wandb", "trainer.max_steps=2", "circuit=ff",
                              "circuit.window=2", "circuit.rank=1", "export=false",
                              "validate_before_training=false"], "wb")  # fmt: skip
    train(cfg)
    runs = list((tmp_path / "wb").rglob("offline-run-*"))
    assert runs, "wandb wrote no offline run"


def _trainable(run_dir: Path) -> dict[str, torch.Tensor]:
    """The head and LoRA weights of a run folder's last checkpoint."""
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


DDP_RUN = ["circuit=cp", "circuit.window=4", "circuit.rank=2", "lora.layers=1",
           "trainer.max_steps=3", "trainer.limit_val_batches=0", "validate_before_training=false",
           "logger=none", "data.num_rows=300", "data.seq_len=96", "loss.chunk_size=128",
           "trainer.enable_progress_bar=false"]  # fmt: skip
"""Three optimizer steps of head and LoRA (B of LoRA starts at 0: step 1 moves only B)."""


def _two_processes(tmp_path: Path, trainer: str, name: str, *overrides: str) -> None:
    """``python train.py trainer=<trainer>`` (2 CPU processes, 2 sequences each) in ``name``."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(REPO / "train.py"), f"trainer={trainer}", "data.batch_size=2",
               f"hydra.run.dir={tmp_path / name}", *DDP_RUN, *overrides]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert OmegaConf.load(tmp_path / name / ".hydra" / "config.yaml").trainer.devices == 2


def _assert_same_training(tmp_path: Path, runs: dict[str, Path]) -> None:
    """Each run's head and LoRA weights equal 1 process x 4 sequences, 3 steps."""
    single_cfg = _compose(tmp_path, [*DDP_RUN, "data.batch_size=4"], "single", fast=[])
    L.seed_everything(0)  # train() seeds, then builds the draft: the weights every run starts from
    start = MTPCLightningModule(
        build_model(**TrainSettings.from_cfg(single_cfg).model_arguments())
    ).trainable_state_dict()
    train(single_cfg)
    single = _trainable(tmp_path / "single")
    assert any("lora_A" in k for k in single) and any(".head." in k for k in single)
    for label, folder in runs.items():
        got = _trainable(folder)
        assert sorted(got) == sorted(single) == sorted(start), label
        assert json.loads((folder / "metrics.json").read_text())["train/steps"] == 3
        assert (folder / "draft" / "head.safetensors").exists()
        for name in got:
            moved = (single[name] - start[name]).abs().max()
            assert moved > 5e-4, name  # every tensor trained (else the comparison proves nothing)
            # measured: DDP vs 1 process <= 1.0e-5 (weights moved >= 1.0e-3: CP sum_bias); no sync: 9.6e-3
            torch.testing.assert_close(got[name], single[name], rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.slow
def test_ddp_and_fsdp_on_two_cpu_processes_equal_one_process_over_the_same_global_batch(
    tmp_path: Path,
) -> None:
    """2 gloo ranks x 2 sequences == 1 process x 4 sequences, weight for weight.

    Rank r reads positions r, r + 2, ... of the epoch's permutation, so the two ranks' batches
    together are the single process's batch; the loss is a mean over sequences, so the
    averaged gradient is the single process's. A DDP run whose ranks never all-reduce their
    gradients fails here (checked once by hand on a strategy that skips the reduction: Adam's
    first step moves each weight by about lr x sign(gradient), and half a batch's signs differ).
    FSDP2 (``trainer=fsdp_cpu``: frozen trunk weights beside trainable LoRA weights in one
    sharded layer) runs 2 steps, checkpoints, and resumes for the third.
    """
    _two_processes(tmp_path, "ddp_cpu", "ddp")
    fsdp = ["callbacks.checkpoint_every_n_steps=1"]
    _two_processes(tmp_path, "fsdp_cpu", "fsdp", *fsdp, "trainer.max_steps=2")
    assert torch.load(tmp_path / "fsdp" / "checkpoints" / "last.ckpt", weights_only=False)[
        "global_step"
    ] == 2  # fmt: skip
    _two_processes(tmp_path, "fsdp_cpu", "fsdp", *fsdp, "trainer.max_steps=3")
    log = (tmp_path / "fsdp" / "train.log").read_text()
    assert log.count("resuming from") == 1, log  # step 3 continued the sharded checkpoint
    _assert_same_training(tmp_path, {"ddp": tmp_path / "ddp", "fsdp": tmp_path / "fsdp"})


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(REPO / "train.py"), "-m", *overrides, "logger=csv",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", *FAST]  # fmt: skip
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)


@pytest.mark.slow
def test_multirun_sweep_over_a_field_outside_the_run_name_resumes_each_job(tmp_path: Path) -> None:
    """python train.py -m optimizer.lr=1e-3,3e-3: one folder per job, named by what varied."""
    sweep = ["optimizer.lr=1e-3,3e-3", "circuit=ff", "circuit.window=2",
             "validate_before_training=false", "callbacks.checkpoint_every_n_steps=1"]  # fmt: skip
    first = _sweep(tmp_path, *sweep, "trainer.max_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]  # was: the second job refused (exit 2)
    base = tmp_path / "sweep" / "tiny-ff-n2-r1-k0-heads"
    shared = "data.batch_size=4,data.num_rows=300,data.seq_len=96,loss.chunk_size=128"
    jobs = sorted(p.name for p in base.iterdir())
    assert jobs == [f"{shared},optimizer.lr=0.001", f"{shared},optimizer.lr=0.003"]
    for job in jobs:
        assert json.loads((base / job / "metrics.json").read_text())["train/steps"] == 1
        state = torch.load(base / job / "checkpoints" / "last.ckpt", weights_only=False)
        lr = state["optimizer_states"][0]["param_groups"][0]["lr"]
        assert f"optimizer.lr={lr}" in job  # each folder holds the run its name says

    # the same sweep with a longer budget resumes every job in its own folder
    again = _sweep(tmp_path, *sweep, "trainer.max_steps=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in base.iterdir()) == jobs
    for job in jobs:
        assert json.loads((base / job / "metrics.json").read_text())["train/steps"] == 2
        assert sorted(_read_losses(base / job)) == [0, 1]  # step 0 once: resumed, not redone

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from sweep_eval import find_drafts
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert find_drafts(tmp_path / "sweep") == [base / job / "draft" for job in jobs]


def test_kl_distillation_loss_trains_the_head(tmp_path: Path) -> None:
    """loss=kl: forward KL to the target's own next-byte distributions goes down."""
    model = MTPCModel.from_hf(_random_llama(), kind="btree", window=3, rank=2, lora_layers=0)
    with torch.no_grad():
        model.head.unembedding.normal_(0.0, 0.5)  # start away from the target
    datamodule = build_datamodule(
        source="synthetic", codec="tiny", seq_len=32, window=3, batch_size=2, num_rows=200,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    module = MTPCLightningModule(
        model, loss="kl", optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), chunk_size=32
    )
    losses = _optimise(module, batch, steps=10)
    assert losses[0] > 0 and losses[-1] < 0.8 * losses[0], losses


def test_global_batch_size_sets_gradient_accumulation(tmp_path: Path) -> None:
    from mtpc.training.run import _accumulation
    from mtpc.training.settings import TrainSettings

    cfg = _compose(tmp_path, ["global_batch_size=256", "data.batch_size=4"])
    settings = TrainSettings.from_cfg(cfg)
    assert _accumulation(settings, world_size=8) == 8  # 256 sequences = 4 x 8 ranks x 8 batches
    assert _accumulation(settings, world_size=1) == 64
    cfg.global_batch_size = None
    assert _accumulation(TrainSettings.from_cfg(cfg), world_size=8) == 1


def test_the_slurm_launcher_config_composes_and_writes_the_expected_submission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hydra/launcher=slurm: the sbatch script submitit would submit, captured before sbatch."""
    require_extra("slurm")
    from submitit.slurm.slurm import SlurmExecutor

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "trainer=ddp", f"hydra.sweep.dir={tmp_path}",
                       "hydra.launcher.partition=gpu", "hydra.launcher.account=mtpc"],
            return_hydra_config=True,
        )  # fmt: skip
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    scripts: list[str] = []

    class Captured(Exception):
        pass

    def capture(executor: SlurmExecutor, command: str) -> None:
        scripts.append(executor._make_submission_file_text(command, "uid"))
        raise Captured

    monkeypatch.setattr(SlurmExecutor, "_submit_command", capture)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun here
    with pytest.raises(Captured):
        launcher.launch([["circuit=ff"], ["circuit=cp"]], initial_job_idx=0)
    (script,) = scripts
    flags = {line for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {
        "#SBATCH --array=0-1%2", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=8", "#SBATCH --mem=480GB",
        "#SBATCH --time=1440", "#SBATCH --partition=gpu", "#SBATCH --account=mtpc",
    } <= flags, sorted(flags)  # fmt: skip
    assert "srun" in script and "submitit.core._submit" in script
    assert str(tmp_path / ".submitit") in script  # logs and pickles under the sweep folder
