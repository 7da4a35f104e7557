"""The settings of a training run, read from the Hydra config once, at the door, by
:meth:`TrainSettings.from_cfg` (docs/TRAINING.md, "Training MTPC drafts"). Each default is
written once, here, and equals what ``train(cfg)`` takes for a missing key (a comment names a
config file that gives another). Values are kept as given: ``validate_train_config`` or
Lightning refuses bad ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpc.choices import LORA_TARGET_MODULES as LORA_MODULES

# lora.target_modules of configs/lora/default.yaml

_Settings = TypeVar("_Settings")


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """``cfg``'s field ``key`` (dotted) as plain Python; ``default`` if missing (null: None)."""
    value = OmegaConf.select(cfg, key, default=default)
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _node(cfg: DictConfig, key: str) -> Any:
    """``cfg``'s section ``key`` as it is (a config node, unresolved); None if missing or empty."""
    return OmegaConf.select(cfg, key) or None


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


def _recorded(cfg: DictConfig) -> dict[str, Any]:
    """The config as written (interpolations kept), plain containers."""
    recorded = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(recorded, dict)
    return {str(k): v for k, v in recorded.items()}


@dataclass(frozen=True)
class ModelArgs:
    """The target to load (``model.*``; ``configs/model/tiny.yaml``'s by default)."""

    name: str = "tiny"
    path: str | None = None  # a local checkpoint or hub id; None: the model's default
    revision: str | None = None
    dtype: str = "float32"
    attention_impl: str = "auto"  # EvaByte's attention path


@dataclass(frozen=True)
class CircuitSettings:
    """The head (``circuit.*``; ``configs/circuit/btree.yaml``'s by default)."""

    kind: str = "btree"
    window: int = 8  # n, the bytes one draft proposes
    rank: int = 8  # r, the units per region
    # the section's other keys, as given (btree.yaml: sum_init_std, identity_init, extra_positions)
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA on a draft copy of the last layers (``lora.*``; ``configs/lora/default.yaml``)."""

    layers: int = 0  # k, the copied layers (0: heads only)
    rank: int = 16
    alpha: float = 32.0  # the adapters' scale numerator
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_MODULES


@dataclass(frozen=True)
class LossSettings:
    """The training loss (``loss.*``; ``configs/loss/nll.yaml``)."""

    name: str = "nll"
    gamma: float | None = None  # None: the loss's default (0.8, or 0.9 when window > 8)
    normalise_discount: bool = False
    chunk_size: int = 1024  # positions per likelihood chunk (missing, null or 0: this)


@dataclass(frozen=True)
class CallbackSettings:
    """The checkpoint policy (``callbacks.*``; ``configs/callbacks/default.yaml``)."""

    # last.ckpt every this many steps too; None: at epochs' ends only (default.yaml sets 50)
    checkpoint_every_n_steps: int | None = None
    monitor: str = "val/loss"  # the best checkpoints' metric (lower is better)
    save_top_k: int = 1


@dataclass(frozen=True)
class TrainerSettings:
    """The Lightning trainer (``trainer.*``): the fields ``train`` reads, and the section."""

    accelerator: str | None = None  # configs/trainer/cpu.yaml: cpu
    devices: Any = 1  # processes per node (an int, ``auto``, a list)
    num_nodes: int = 1  # missing, null or 0: this
    accumulate_grad_batches: int = 1  # without global_batch_size; missing, null or 0: this
    fast_dev_run: bool = False  # also: no checkpoint resumed, no export, no logger
    max_steps: int | None = None  # -1 or None: no budget; cpu.yaml sets 300
    max_epochs: int | None = None  # -1 or None: no budget; cpu.yaml sets 1
    limit_val_batches: Any = None
    strategy: Any = None  # a dict is instantiated
    fields: Mapping[str, Any] = field(default_factory=dict)  # L.Trainer's keywords (_target_ too)


@dataclass(frozen=True)
class RunSettings:
    """The run's own fields (top-level keys of ``configs/train.yaml``)."""

    run_name: str | None = None  # train.yaml builds it from the model, circuit, LoRA, stage
    run_dir: str | None = None  # outside a Hydra run; None: outputs/train/<run_name>
    # paths.root_dir, where outputs/last_draft.txt goes (paths/default.yaml: $PROJECT_ROOT or .)
    root_dir: str = "."
    seed: int = 0
    init_from: str | None = None  # a previous stage's exported draft or checkpoint
    export: bool = True  # write the exported draft to <run dir>/draft
    validate_before_training: bool = True  # measure the untrained draft (init/...)
    allow_resume_changes: bool = False
    global_batch_size: int | None = None  # None: trainer.accumulate_grad_batches


@dataclass(frozen=True)
class Sections:
    """The sections Hydra instantiates (``data``, ``optimizer``, ``scheduler``, ``logger``; None
    when missing or empty), as config nodes so that their interpolations (``${paths...}``,
    ``${hydra:...}``) resolve as Hydra's ``instantiate`` resolves them, and two fields."""

    data: Any = None
    optimizer: Any = None
    scheduler: Any = None
    logger: Any = None
    batch_size: int | None = None  # data.batch_size: sequences per batch and rank
    lr: Any = None  # optimizer.lr as given (the new lr of a resume that changes it)


def _read(
    cfg: DictConfig,
    prefix: str,
    cls: type[_Settings],
    or_default: tuple[str, ...] = (),
    **casts: Callable[[Any], Any],
) -> _Settings:
    """``cls`` from ``cfg``'s keys ``<prefix><field>``: a missing key (for the fields
    ``or_default``, also a null or 0) takes the field's default; ``casts`` convert named fields."""
    default: Any = cls()
    values = {}
    for item in fields(default):
        value = _get(cfg, prefix + item.name, getattr(default, item.name))
        if item.name in or_default:
            value = value or getattr(default, item.name)
        values[item.name] = casts[item.name](value) if item.name in casts else value
    return cls(**values)


@dataclass(frozen=True)
class TrainSettings:
    """Everything ``train(cfg)`` reads from its config, read once by :meth:`from_cfg`."""

    model: ModelArgs = field(default_factory=ModelArgs)
    circuit: CircuitSettings = field(default_factory=CircuitSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    callbacks: CallbackSettings = field(default_factory=CallbackSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    run: RunSettings = field(default_factory=RunSettings)
    sections: Sections = field(default_factory=Sections)
    recorded: Mapping[str, Any] = field(default_factory=dict)  # as written: the draft's record
    resolved: Mapping[str, Any] = field(default_factory=dict)  # plain: a resume compares it

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> TrainSettings:
        """The settings of a composed training config (run after ``validate_train_config``)."""
        circuit = dict(_get(cfg, "circuit") or {})
        ci = CircuitSettings()
        counts = ("num_nodes", "accumulate_grad_batches")
        trainer = _read(cfg, "trainer.", TrainerSettings, counts,
                        num_nodes=int, accumulate_grad_batches=int, fast_dev_run=bool)  # fmt: skip
        run = _read(cfg, "", RunSettings, seed=int, export=bool, validate_before_training=bool,
                    allow_resume_changes=bool)  # fmt: skip
        loss = _read(cfg, "loss.", LossSettings, ("chunk_size",),
                     normalise_discount=bool, chunk_size=int)  # fmt: skip
        return cls(
            model=_read(cfg, "model.", ModelArgs),
            circuit=CircuitSettings(
                kind=circuit.pop("kind", ci.kind),
                window=circuit.pop("window", ci.window),
                rank=circuit.pop("rank", ci.rank),
                options={str(k): v for k, v in circuit.items()},
            ),
            lora=_read(
                cfg, "lora.", LoraSettings, alpha=float, dropout=float, target_modules=tuple
            ),
            loss=loss,
            callbacks=_read(cfg, "callbacks.", CallbackSettings, save_top_k=int),
            trainer=replace(trainer, fields=dict(_get(cfg, "trainer") or {})),
            run=replace(run, root_dir=_get(cfg, "paths.root_dir", RunSettings.root_dir)),
            sections=Sections(
                **{k: _node(cfg, k) for k in ("data", "optimizer", "scheduler", "logger")},
                batch_size=_get(cfg, "data.batch_size"),
                lr=_get(cfg, "optimizer.lr"),
            ),
            recorded=_recorded(cfg),
            resolved=resolved_config(cfg),
        )

    def model_arguments(self) -> dict[str, Any]:
        """The flat arguments of :func:`mtpc.training.run.build_model`: ``model.*``, the
        ``circuit`` (its other keys are the head's options), ``lora.*`` (as ``lora_<field>``),
        ``loss.chunk_size`` and ``trainer.accelerator``."""
        c = self.circuit
        return {
            **asdict(self.model),
            "accelerator": self.trainer.accelerator,
            "chunk_size": self.loss.chunk_size,
            "kind": c.kind,
            "window": c.window,
            "rank": c.rank,
            **dict(c.options),
            **{f"lora_{k}": v for k, v in asdict(self.lora).items()},
            "lora_target_modules": list(self.lora.target_modules),
        }
