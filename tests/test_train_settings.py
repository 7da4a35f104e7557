"""A training run's settings are read from the config once, at the door (issue 32).

``TrainSettings.from_cfg`` is the only reader of the raw config in ``mtpc/training``; the
embedded default config parses to the documented values; the settings are frozen.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from mtpc.training.settings import (
    LORA_MODULES,
    CallbackSettings,
    CircuitSettings,
    LoraSettings,
    LossSettings,
    ModelArgs,
    RunSettings,
    TrainerSettings,
    TrainSettings,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"


def _compose(overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides or [])


def test_the_embedded_default_parses_to_the_documented_settings() -> None:
    cfg = _compose()
    settings = TrainSettings.from_cfg(cfg)
    assert settings.model == ModelArgs()  # configs/model/tiny.yaml
    assert settings.circuit == CircuitSettings(
        options={"sum_init_std": 0.02, "identity_init": True, "extra_positions": "random"}
    )  # configs/circuit/btree.yaml
    assert settings.lora == LoraSettings() and settings.lora.target_modules == LORA_MODULES
    assert settings.loss == LossSettings()  # configs/loss/nll.yaml
    assert settings.callbacks == CallbackSettings(checkpoint_every_n_steps=50)
    trainer = dataclasses.replace(settings.trainer, fields={})
    assert trainer == TrainerSettings(accelerator="cpu", max_steps=300, max_epochs=1)
    assert settings.trainer.fields["_target_"] == "lightning.Trainer"
    # root_dir: ${oc.env:PROJECT_ROOT,.}, which a test before this one may have set
    root = cfg.paths.root_dir
    assert settings.run == RunSettings(run_name="tiny-btree-n8-r8-k0-heads", root_dir=root)
    assert settings.sections.batch_size == 4 and settings.sections.lr == 3.0e-3
    assert settings.sections.scheduler is None
    assert isinstance(settings.sections.data, DictConfig)  # instantiated by Hydra, as given


def test_missing_keys_take_the_defaults_train_took_inline() -> None:
    cfg = _compose()
    for section, key in [
        ("callbacks", "monitor"),
        ("callbacks", "save_top_k"),
        ("loss", "chunk_size"),
        ("model", "attention_impl"),
        ("trainer", "devices"),
        ("trainer", "num_nodes"),
    ]:
        with open_dict(cfg[section]):
            cfg[section].pop(key, None)
    for key in ("export", "validate_before_training", "allow_resume_changes"):
        with open_dict(cfg):
            cfg.pop(key)
    settings = TrainSettings.from_cfg(cfg)
    assert (settings.callbacks.monitor, settings.callbacks.save_top_k) == ("val/loss", 1)
    assert settings.loss.chunk_size == 1024 and settings.model.attention_impl == "auto"
    assert (settings.trainer.devices, settings.trainer.num_nodes) == (1, 1)
    assert settings.run.export and settings.run.validate_before_training
    assert not settings.run.allow_resume_changes


@pytest.mark.parametrize("value", ["null", "0"])
def test_null_or_zero_counts_take_their_defaults(value: str) -> None:
    """loss.chunk_size, trainer.num_nodes and trainer.accumulate_grad_batches: null or 0 is
    the default (as train took ``x or default`` inline), not the value as given."""
    cfg = _compose([f"loss.chunk_size={value}", f"++trainer.num_nodes={value}",
                    f"++trainer.accumulate_grad_batches={value}"])  # fmt: skip
    settings = TrainSettings.from_cfg(cfg)
    assert settings.loss.chunk_size == 1024
    assert (settings.trainer.num_nodes, settings.trainer.accumulate_grad_batches) == (1, 1)


def test_the_model_arguments_are_the_configs() -> None:
    cfg = _compose(["circuit=cp", "lora.layers=2", "loss=kl", "loss.chunk_size=64"])
    args = TrainSettings.from_cfg(cfg).model_arguments()
    circuit = OmegaConf.to_container(cfg.circuit, resolve=True)
    assert isinstance(circuit, dict)
    c = args["circuit"]  # the sections themselves (build_model's keywords), not flat lora_*
    assert {"kind": c.kind, "window": c.window, "rank": c.rank, **c.options} == circuit
    assert args["lora"].layers == 2 and args["chunk_size"] == 64
    assert args["lora"].target_modules == LORA_MODULES


def test_the_whole_config_is_kept_as_data_for_the_export_and_the_resume() -> None:
    cfg = _compose()
    settings = TrainSettings.from_cfg(cfg)
    assert settings.recorded == OmegaConf.to_container(cfg, resolve=False)
    assert settings.resolved["run_name"] == "tiny-btree-n8-r8-k0-heads"


def test_the_settings_are_frozen() -> None:
    settings = TrainSettings.from_cfg(_compose())
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.loss = LossSettings(name="kl")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.trainer.max_steps = 1  # type: ignore[misc]


RAW_READS = re.compile(
    r"\b(?:cfg|trainer_cfg)\b(?:\.\w+)*\.get\("  # cfg.get(, cfg.trainer.get(, trainer_cfg.get(
    r"|\bcfg\.(?!get\b)\w+"  # dotted lookups: cfg.loss, cfg.trainer.devices
    r"|\bcfg\[|\bget_field\("  # cfg["seed"], the dotted getter
)


def test_no_raw_config_reads_below_the_door() -> None:
    """Only ``mtpc/training/settings.py`` reads the raw config (``TrainSettings.from_cfg``)."""
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted((REPO / "mtpc" / "training").glob("*.py"))
        if path.name != "settings.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RAW_READS.search(line.split("#")[0])
    ]
    assert not found, "read the config in TrainSettings.from_cfg instead:\n" + "\n".join(found)


def test_the_pattern_flags_raw_reads_and_spares_other_dicts() -> None:
    for line in (
        'cfg.get("run_dir")',
        'cfg.trainer.get("devices", 1)',
        'trainer_cfg.get("strategy")',
        "cfg.loss.name",
        'get_field(cfg, "a.b")',
    ):
        assert RAW_READS.search(line), line
    for line in ('state.get("global_step", 0)', 'options["data_parallel_size"]', "train(cfg)"):
        assert not RAW_READS.search(line), line
