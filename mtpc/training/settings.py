"""The schema of a training run (docs/TRAINING.md, "Training MTPC drafts"): every setting
``train(cfg)`` reads, declared once with its default and its rule (``mtpc.config``), read and
checked once, at the door, by :meth:`TrainSettings.from_cfg`. Each default equals what
``train(cfg)`` takes for a missing key (a comment names a config file that gives another)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtpc.choices import CIRCUIT_KINDS, EXTRA_POSITIONS, HEAD_INITS, LOSS_NAMES, STAGES
from mtpc.choices import LORA_TARGET_MODULES as LORA_MODULES  # noqa: F401  (tests)
from mtpc.config import (
    ConfigError,
    DataChecks,
    LoraSettings,
    ModelSettings,
    checked_as,
    choice,
    computed,
    flag,
    integer,
    is_integer,
    is_number,
    number,
    read,
    rule,
    section,
    setting,
)

ModelArgs = ModelSettings  # the target to load (``model.*``)


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers, resolved where it can be (``hydra:`` needs Hydra)."""
    plain: dict[str, Any] = {}
    for key in cfg:
        node = OmegaConf.is_config(cfg._get_node(str(key)))
        try:
            plain[str(key)] = OmegaConf.to_container(cfg[key], resolve=True) if node else cfg[key]
        except Exception:  # an interpolation only Hydra can resolve (``paths.output_dir``)
            plain[str(key)] = OmegaConf.to_container(cfg[key], resolve=False) if node else None
    return plain


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """The head's other options (``circuit.*`` beyond kind, window and rank; None: the head's
    default), checked here, given to ``MTPCHead`` as they are."""

    sum_init_std: float | None = setting(None, number(0.0))
    init_std: float | None = setting(None, number(0.0))
    extra_positions: str | None = setting(None, choice(*EXTRA_POSITIONS))
    head_init: str | None = setting(None, choice(*HEAD_INITS))
    identity_init: bool | None = setting(None, flag())


def _options(circuit: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in circuit.items() if k not in ("kind", "window", "rank")}


@dataclasses.dataclass(frozen=True)
class CircuitSettings:
    """The head (``circuit.*``; ``configs/circuit/btree.yaml``'s by default)."""

    kind: str = setting("btree", choice(*CIRCUIT_KINDS))
    window: int = setting(8, integer(1))  # n, the bytes one draft proposes
    rank: int = setting(8, integer(1))  # r, the units per region
    # the section's other keys, as given (btree.yaml: sum_init_std, identity_init, extra_positions)
    options: Mapping[str, Any] = setting({}, checked_as(HeadOptions), key="", convert=_options)

    def __post_init__(self) -> None:
        if self.kind == "ff" and self.rank != 1:
            raise ConfigError(
                f"circuit.rank={self.rank} is not allowed with circuit.kind=ff; allowed: 1 "
                "(use circuit=cp for a mixture of rank > 1)"
            )


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The training loss (``loss.*``; ``configs/loss/nll.yaml``)."""

    name: str = setting("nll", choice(*LOSS_NAMES))
    # None: the loss's default (0.8, or 0.9 when window > 8)
    gamma: float | None = setting(None, number(0.0, 1.0, low_open=True, high_open=False))
    normalise_discount: bool = setting(False, flag())
    # positions per likelihood chunk (missing, null or 0: this)
    chunk_size: int = setting(1024, integer(1), or_default=True, convert=int)


@dataclasses.dataclass(frozen=True)
class CallbackSettings:
    """The checkpoint policy (``callbacks.*``; ``configs/callbacks/default.yaml``)."""

    # last.ckpt every this many steps too; None: at epochs' ends only (default.yaml sets 50)
    checkpoint_every_n_steps: int | None = setting(None, integer(1, null=True))
    monitor: str = "val/loss"  # the best checkpoints' metric (lower is better)
    save_top_k: int = setting(1, integer(-1))


STEPS = rule(
    lambda v: is_integer(v) and (v >= 1 or v == -1),
    "an integer >= 1, or -1 (the whole epoch); a run of 0 steps would export an untrained draft",
    null=True,
)
VALIDATION_BATCHES = rule(
    lambda v: (is_integer(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0),
    "null (every validation batch), an integer >= 0 (batches per validation; 0 turns validation "
    "off) or a float in [0, 1] (a share of the validation split)",
    null=True,
)
BETAS = rule(
    lambda v: (
        isinstance(v, list | tuple) and len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v)
    ),
    "two numbers in [0, 1), e.g. [0.9, 0.999]",
    null=True,
)
SCHEDULER = rule(
    lambda v: isinstance(v, Mapping) and "_target_" in v,
    "null or a partial LR scheduler, e.g. {_target_: torch.optim.lr_scheduler.LinearLR, "
    "_partial_: true}",
    null=True,
)
POSITIVE = rule(lambda v: is_number(v) and 0 < v < float("inf"), "a number > 0")


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The Lightning trainer (``trainer.*``): the fields ``train`` reads, and the section."""

    accelerator: str | None = None  # configs/trainer/cpu.yaml: cpu
    devices: Any = 1  # processes per node (an int, ``auto``, a list)
    num_nodes: int = setting(1, or_default=True, convert=int)  # missing, null or 0: this
    # without global_batch_size; missing, null or 0: this
    accumulate_grad_batches: int = setting(1, or_default=True, convert=int)
    fast_dev_run: bool = setting(False, convert=bool)  # also: no resume, export, logger
    max_steps: int | None = setting(None, STEPS)  # -1 or None: no budget; cpu.yaml sets 300
    max_epochs: int | None = None  # -1 or None: no budget; cpu.yaml sets 1
    limit_val_batches: Any = setting(None, VALIDATION_BATCHES)
    strategy: Any = None  # a dict is instantiated
    fields: Mapping[str, Any] = setting({}, key="", convert=dict)  # L.Trainer's keywords


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's own fields (top-level keys of ``configs/train.yaml``)."""

    run_name: str | None = None  # train.yaml builds it from the model, circuit, LoRA, stage
    run_dir: str | None = None  # outside a Hydra run; None: outputs/train/<run_name>
    # where outputs/last_draft.txt goes (paths/default.yaml: $PROJECT_ROOT or .)
    root_dir: str = setting(".", key="paths.root_dir")
    seed: int = setting(0, integer(0))
    stage: str = setting("heads", choice(*STAGES))  # lora: continue a heads-only draft
    init_from: str | None = None  # a previous stage's exported draft or checkpoint
    export: bool = setting(True, convert=bool)  # write the exported draft to <run dir>/draft
    validate_before_training: bool = setting(True, convert=bool)  # the untrained draft's
    allow_resume_changes: bool = setting(False, convert=bool)
    global_batch_size: int | None = setting(None, integer(1, null=True))  # None: accumulate

    def __post_init__(self) -> None:
        if self.stage == "lora" and not self.init_from:
            raise ConfigError(
                "stage=lora needs init_from=<exported draft dir or Lightning checkpoint> "
                "(the heads-only stage's result); allowed without it: stage=heads"
            )


@dataclasses.dataclass(frozen=True)
class OptimizerChecks:
    """AdamW's fields checked at the door (``optimizer.*``; the lr: ``Sections.lr``)."""

    weight_decay: float | None = setting(None, number(0.0))
    betas: Any = setting(None, BETAS)


def _node(value: Any) -> Any:
    return value or None


@dataclasses.dataclass(frozen=True)
class Sections:
    """The sections Hydra instantiates (``data``, ``optimizer``, ``scheduler``, ``logger``; None
    when missing or empty), as config nodes so that their interpolations (``${paths...}``,
    ``${hydra:...}``) resolve as Hydra's ``instantiate`` resolves them, and two fields."""

    data: Any = setting(None, checked_as(DataChecks), node=True, convert=_node)
    optimizer: Any = setting(None, checked_as(OptimizerChecks), node=True, convert=_node)
    scheduler: Any = setting(None, SCHEDULER, node=True, convert=_node)
    logger: Any = setting(None, node=True, convert=_node)
    batch_size: int | None = setting(None, key="data.batch_size")  # sequences per batch, rank
    # optimizer.lr as given (the new lr of a resume that changes it)
    lr: Any = setting(None, POSITIVE, key="optimizer.lr")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything ``train(cfg)`` reads from its config."""

    model: ModelSettings = section(ModelSettings, "model")
    circuit: CircuitSettings = section(CircuitSettings, "circuit")
    lora: LoraSettings = section(LoraSettings, "lora")
    loss: LossSettings = section(LossSettings, "loss")
    callbacks: CallbackSettings = section(CallbackSettings, "callbacks")
    trainer: TrainerSettings = section(TrainerSettings, "trainer")
    run: RunSettings = section(RunSettings)
    sections: Sections = section(Sections)
    recorded: Mapping[str, Any] = computed({})  # as written: the exported draft's record
    resolved: Mapping[str, Any] = computed({})  # plain: a resume compares it

    def model_arguments(self) -> dict[str, Any]:
        """The keywords of :func:`mtpc.training.run.build_model`: the sections it needs."""
        return {
            "model": self.model,
            "circuit": self.circuit,
            "lora": self.lora,
            "chunk_size": self.loss.chunk_size,
            "accelerator": self.trainer.accelerator,
        }

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> TrainSettings:
        """The settings of a composed training config; a bad value: :class:`ConfigError`."""
        recorded = OmegaConf.to_container(cfg, resolve=False)
        assert isinstance(recorded, dict)
        as_written = {str(k): v for k, v in recorded.items()}
        return read(cls, cfg, recorded=as_written, resolved=resolved_config(cfg))


def validate_train_config(cfg: Any) -> None:
    """Raises :class:`ConfigError` naming the first invalid field of a training config."""
    read(TrainSettings, cfg)
