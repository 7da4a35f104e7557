"""``train(cfg)``: the whole training job behind ``python train.py`` and sweeps: validate, build
the data and the draft, measure it untrained, fit (resuming from ``last.ckpt``), export the draft
and write ``metrics.json``. See docs/TRAINING.md."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from mtpc.config import ConfigError, LoraSettings, ModelSettings
from mtpc.errors import UserError
from mtpc.files import FolderBusy, FolderLock, remove_stale_tmp
from mtpc.last_draft import recorded_run
from mtpc.model import MTPCModel
from mtpc.training.callbacks import AtomicCheckpointIO, RNGStateCallback, RunRecordCallback
from mtpc.training.module import MTPCLightningModule
from mtpc.training.resume import (
    RunFolderBusyError,
    check_resume,
    comparable_config,
    find_resume_checkpoint,
    is_global_zero,
    restore_hydra,
    snapshot_hydra,
)
from mtpc.training.settings import (
    CircuitSettings,
    RunSettings,
    TrainerSettings,
    TrainSettings,
)

log = logging.getLogger(__name__)


def build_model(
    model: ModelSettings,
    circuit: CircuitSettings,
    lora: LoraSettings,
    *,
    chunk_size: int,
    accelerator: str | None,
) -> MTPCModel:
    """The draft to train (:meth:`TrainSettings.model_arguments`). The target is loaded first
    (on the CPU), then, before the head is allocated, the head's memory and the ``lora.*``
    settings are checked against the device and the target."""
    from mtpc.backbones import load_backbone, run_device_for
    from mtpc.backbones.lora import LoraError

    run_device = run_device_for(accelerator)
    backbone = load_backbone(model.name, path=model.path, revision=model.revision,
                             dtype=model.dtype, device="cpu",
                             attention_impl=model.attention_impl, run_device=run_device)  # fmt: skip
    n, r = circuit.window, circuit.rank
    check_head_memory(n, r, chunk_size, accelerator, backbone.vocab_size, backbone.hidden_size)
    try:
        return MTPCModel.from_backbone(backbone, circuit.kind, n, r, lora=lora, **circuit.options)
    except LoraError as err:  # the lora.* settings against the target's layers
        raise ConfigError(f"{err} (model={model.name})") from None


GIB = 1024**3


def available_memory(accelerator: str | None) -> tuple[str, int | None]:
    """The name and free bytes (None: unknown) of the device ``trainer.accelerator`` names."""
    if str(accelerator or "cpu") in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return "cuda", int(torch.cuda.mem_get_info()[0])
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return "cpu", int(line.split()[1]) * 1024
    return "cpu", None


def check_head_memory(
    n: int, r: int, chunk: int, accelerator: str | None, vocab_size: int, hidden_size: int
) -> None:
    """Refuses (ConfigError) a head whose estimated float32 training memory exceeds the free
    memory of ``accelerator``'s device: the n*r*V*d unembedding, its gradient and Adam's two
    moments (3x), and one loss chunk's (chunk, n, r, V) logits, log-softmax and gradient (3x)."""
    params = n * r * vocab_size * hidden_size * 4
    optimizer = 3 * params
    logits = chunk * n * r * vocab_size * 4 * 3
    device, free = available_memory(accelerator)
    total = params + optimizer + logits
    if free is None or total <= free:
        return
    raise ConfigError(
        f"circuit.window={n} circuit.rank={r} needs about {total / GIB:.1f} GiB to train "
        f"(n*r*V*d = {n}*{r}*{vocab_size}*{hidden_size} = {n * r * vocab_size * hidden_size:.3g} "
        f"parameters: {params / GIB:.1f} GiB, gradient and Adam state "
        f"{optimizer / GIB:.1f} GiB, loss.chunk_size={chunk} logits "
        f"{logits / GIB:.1f} GiB) but {device} has {free / GIB:.1f} GiB free; "
        "lower circuit.rank, circuit.window or loss.chunk_size"
    )


def load_initial_weights(model: MTPCModel, init_from: str | Path) -> None:
    """Loads a previous stage's head (and LoRA weights whose shapes match) from an exported
    draft folder or a Lightning checkpoint of this trainer; ConfigError when the path does
    not exist or holds another circuit."""
    from mtpc.export import ADAPTER_NAME, read_config, read_head, read_tensors

    path = Path(init_from)
    if path.is_dir():
        config = read_config(path)
        wanted = {"kind": model.head.kind, "window": model.head.window, "rank": model.head.rank}
        got = {key: config["circuit"].get(key) for key in wanted}
        if got != wanted:
            raise ConfigError(
                f"init_from={path} holds a {got} draft but the config asks for {wanted}; "
                "use the same circuit.kind / circuit.window / circuit.rank as stage 1"
            )
        head_state = read_head(path, config, model.head, "cpu")
        adapter = path / ADAPTER_NAME
        use_adapter = adapter.exists() and model.backbone.lora is not None
        lora = read_tensors(adapter) if use_adapter else {}
    elif path.is_file():
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        except Exception as err:  # truncated, not a Lightning checkpoint
            raise ConfigError(
                f"init_from={path} is not a readable Lightning checkpoint ({err}); pass an "
                "exported draft folder or another checkpoint"
            ) from err
        head_state = {k.removeprefix("model.head."): v for k, v in state.items() if ".head." in k}
        prefix = "model.backbone.lora."
        lora = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    else:
        raise ConfigError(
            f"init_from={path} does not exist; allowed: an exported draft folder "
            "(outputs/train/<run>/draft) or a Lightning checkpoint (.ckpt)"
        )
    model.head.load_state_dict(head_state)
    if model.backbone.lora is not None:
        own = model.lora_state_dict()  # names and shapes that match: k=1 from k=2, say
        usable = {k: v for k, v in lora.items() if k in own and own[k].shape == v.shape}
        model.backbone.lora.load_state_dict(usable, strict=False)
    log.info("initialised the draft from %s", path)


def _accumulation(settings: TrainSettings, world_size: int) -> int:
    """Batches per optimizer step so that one step sees ``global_batch_size`` sequences."""
    global_batch_size = settings.run.global_batch_size
    if global_batch_size is None:
        return settings.trainer.accumulate_grad_batches
    per_step = int(settings.sections.batch_size) * world_size  # type: ignore[arg-type]
    return max(1, math.ceil(int(global_batch_size) / per_step))


def _world_size(trainer: TrainerSettings) -> int:
    devices, nodes = trainer.devices, trainer.num_nodes
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if trainer.accelerator == "gpu" and torch.cuda.is_available():
        return torch.cuda.device_count() * nodes
    return 1


def _run_dir(run: RunSettings) -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # called outside @hydra.main (tests, notebooks)
        return Path(run.run_dir or Path.cwd() / "outputs" / "train" / str(run.run_name))


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float | torch.Tensor)}


def train(cfg: DictConfig) -> dict[str, float]:
    """Trains the draft described by ``cfg`` under the run folder's lock; returns ``val/...``,
    ``init/...`` (the untrained draft's, also after a resume) and ``train/steps``."""
    settings = TrainSettings.from_cfg(cfg)  # the only reading of cfg, checked as it is read
    # the frozen target stays in eval mode on purpose (no dropout in the verifier's states)
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    run_dir = _run_dir(settings.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(run_dir / ".lock", enabled=is_global_zero())
    try:
        lock.acquire()
    except FolderBusy as busy:
        restore_hydra(run_dir)  # Hydra wrote this command's .hydra/ over the owner's
        raise RunFolderBusyError(
            f"run folder {run_dir} is in use by another run ({busy.holder}); wait "
            "for it to finish, or give this run another folder (run_name=<new name>)"
        ) from None
    exports = is_global_zero() and settings.run.export and not settings.trainer.fast_dev_run
    try:  # an exporting run is recorded for a bare eval.py (mtpc/last_draft.py)
        with recorded_run(settings.run.root_dir, run_dir, enabled=exports) as exported:
            return _train_locked(settings, run_dir, exported)
    finally:
        lock.release()


def build_trainer(settings: TrainSettings, run_dir: Path, callbacks: list[L.Callback]) -> L.Trainer:
    """The Lightning trainer of ``trainer.*`` in ``run_dir``; a setting Lightning refuses is
    a one-line ConfigError."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    trainer = settings.trainer
    keywords = copy.deepcopy(dict(trainer.fields))  # L.Trainer's: the section as given
    keywords.pop("_target_", None)
    accelerator = str(trainer.accelerator)
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator} needs CUDA GPUs and this machine has none; "
            "allowed here: trainer=cpu, trainer=ddp_cpu, trainer=fsdp_cpu (docs/TRAINING.md)"
        )
    world_size = _world_size(trainer)
    options = copy.deepcopy(trainer.strategy)
    if isinstance(options, dict):  # trainer=fsdp / fsdp_cpu: a strategy object
        if "data_parallel_size" in options and options["data_parallel_size"] is None:
            options["data_parallel_size"] = world_size  # FSDP2 over every process
        keywords["strategy"] = instantiate(options)
    keywords["accumulate_grad_batches"] = _accumulation(settings, world_size)
    logger_section = settings.sections.logger
    logger = instantiate(logger_section) if logger_section and not trainer.fast_dev_run else False
    try:
        return L.Trainer(
            **{str(key): value for key, value in keywords.items()},
            default_root_dir=str(run_dir),
            logger=logger,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
            enable_checkpointing=True,
        )
    except (MisconfigurationException, ValueError, TypeError) as err:  # trainer.* settings
        message = " ".join(str(err).split())
        raise ConfigError(f"trainer settings refused by Lightning: {message}") from None


def _train_locked(
    settings: TrainSettings, run_dir: Path, exported: Callable[[Path], None]
) -> dict[str, float]:
    checkpoint_dir = run_dir / "checkpoints"
    for folder in (checkpoint_dir, run_dir, run_dir / "draft"):  # interrupted writes
        remove_stale_tmp(folder)
    fast = settings.trainer.fast_dev_run
    comparable = comparable_config(settings.resolved)
    resume = None if fast else find_resume_checkpoint(checkpoint_dir)
    init_metrics, new_lr = check_resume(settings, run_dir, comparable, resume)
    snapshot_hydra(run_dir)
    # the trainer first: Lightning's refusals (devices, precision, accelerator) in seconds
    policy = settings.callbacks
    last = ModelCheckpoint(
        dirpath=checkpoint_dir,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=policy.checkpoint_every_n_steps,
        save_on_train_epoch_end=True,
    )
    best = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="best-{step}",
        monitor=policy.monitor,
        mode="min",
        save_top_k=policy.save_top_k,
        auto_insert_metric_name=False,
    )
    record = RunRecordCallback(comparable, init_metrics, new_lr)
    trainer = build_trainer(settings, run_dir, [last, best, RNGStateCallback(), record])
    L.seed_everything(settings.run.seed, workers=True)
    sections, loss = settings.sections, settings.loss
    datamodule = instantiate(sections.data)
    model = build_model(**settings.model_arguments())
    if settings.run.init_from:
        load_initial_weights(model, settings.run.init_from)
    module = MTPCLightningModule(
        model,
        loss=loss.name,
        gamma=loss.gamma,
        normalise_discount=loss.normalise_discount,
        chunk_size=loss.chunk_size,
        optimizer=instantiate(sections.optimizer),
        scheduler=instantiate(sections.scheduler) if sections.scheduler else None,
    )
    ckpt_path = None if resume is None else str(resume[0])
    if ckpt_path is None and settings.run.validate_before_training and not fast:
        initial = trainer.validate(module, datamodule=datamodule, verbose=False)
        if initial:  # into init_metrics, which the run record callback holds
            init_metrics.update({f"init/{k}": v for k, v in _scalars(initial[0]).items()})
    elif ckpt_path is not None:
        log.info("resuming from %s", ckpt_path)
    metrics = dict(init_metrics)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics.update(_scalars(trainer.callback_metrics))
    if not fast and trainer.limit_val_batches != 0:  # the final draft, whatever the schedule
        final = trainer.validate(module, datamodule=datamodule, verbose=False)
        if final:
            metrics.update(_scalars(final[0]))
    metrics["train/steps"] = float(trainer.global_step)
    if trainer.global_step == 0 and not fast:
        raise UserError(
            f"the run in {run_dir} took no optimizer step (trainer.max_steps="
            f"{settings.trainer.max_steps}, {len(datamodule.datasets.get('train', []))} training "
            "sequences): nothing was trained, so no draft is exported"
        )
    export = settings.run.export and not fast
    if export:  # every rank takes part in gathering sharded weights
        model = unsharded_copy(settings, module)
    if trainer.is_global_zero:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        if export:
            draft_dir = model.save_pretrained(
                run_dir / "draft",
                training_config=copy.deepcopy(dict(settings.recorded)),
                metrics=metrics,
            )
            exported(Path(draft_dir))  # outputs/last_draft.txt names it
            log.info("exported the draft to %s", draft_dir)
    return metrics


def unsharded_copy(settings: TrainSettings, module: MTPCLightningModule) -> MTPCModel:
    """The trained draft as an ordinary model, for export: ``module.model`` unless FSDP2 sharded
    it (``trainer=fsdp_cpu``). Then collective: rank 0 gets the gathered trained weights in a
    rebuilt model, the others the sharded one."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return module.model
    full = module.gathered_trainable_state()  # rank 0: {name: whole tensor on CPU}; others: {}
    if not full:
        return module.model
    copy = build_model(**settings.model_arguments())
    trained = {name.removeprefix("model."): full[name] for name in module.trainable_state_dict()}
    missing = set(trained) - set(copy.state_dict())
    assert not missing, f"trained weights without a place in the copy: {sorted(missing)[:3]}"
    copy.load_state_dict(trained, strict=False)
    return copy
