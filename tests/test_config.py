"""Every config composes, and every kind of config error fails at startup naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from mtpc.config import ConfigError
from mtpc.evaluation.settings import parse_eval
from mtpc.training.settings import validate_train_config
from tests.helpers import require_extra

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def _compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides or [])


def _group_options() -> list[tuple[str, str]]:
    """(group, option) for every yaml file under configs/ that is a selectable option."""
    options = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONFIG_DIR)
        if len(rel.parts) == 1 or rel.parts[0] in ("hydra", "drafter", "prompts"):
            continue  # hydra/: launchers (below); drafter/, prompts/: eval.yaml groups (below)
        # a subfolder of a group holds more of its options: experiment=code/btree_n16_r32
        options.append((rel.parts[0], "/".join((*rel.parts[1:-1], rel.stem))))
    return options


def test_defaults_compose_and_validate() -> None:
    cfg = _compose("train")
    validate_train_config(cfg)
    assert cfg.model.name == "tiny"
    parse_eval(_compose("eval"))


@pytest.mark.parametrize(("group", "option"), _group_options())
@pytest.mark.slow
def test_every_config_file_composes(group: str, option: str) -> None:
    if (group, option) == ("hparams_search", "optuna"):
        require_extra("sweep")
    overrides = [f"{group}={option}"]
    cfg = _compose("train", overrides)
    OmegaConf.to_container(cfg.model)  # the node resolves
    if group not in ("hparams_search",):
        validate_train_config(cfg)


@pytest.mark.parametrize("drafter", ["hetero"])
def test_eval_drafter_configs_compose(drafter: str) -> None:
    cfg = _compose("eval", [f"drafter={drafter}"])
    parse_eval(cfg)
    assert cfg.drafter.algorithm in ("slem", "tli", "slrs", "union", "standard")


@pytest.mark.parametrize("prompts", sorted(p.stem for p in (CONFIG_DIR / "prompts").glob("*.yaml")))
def test_eval_prompts_configs_compose(prompts: str, tmp_path: Path) -> None:
    questions = tmp_path / "question.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["Hi."]}\n')
    cfg = _compose("eval", [f"prompts={prompts}", f"prompts.path={questions}"])
    parse_eval(cfg)
    assert cfg.prompts.name == prompts


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_launchers_compose(launcher: str) -> None:
    if launcher == "slurm":
        require_extra("slurm")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[f"hydra/launcher={launcher}"],
            return_hydra_config=True,
        )
    assert "launcher" in cfg.hydra


def test_config_choices_match_the_head() -> None:
    from mtpc.config import EXTRA_POSITIONS, HEAD_INITS
    from mtpc.heads import EXTRA_POSITIONS as HEAD_EXTRA_POSITIONS
    from mtpc.model import HEAD_INITS as MODEL_HEAD_INITS

    assert EXTRA_POSITIONS == HEAD_EXTRA_POSITIONS
    assert HEAD_INITS == MODEL_HEAD_INITS


def test_sweep_folders_leave_out_every_field_a_resume_may_change() -> None:
    """A re-sweep with a longer budget (or other hardware) resumes each job in its folder:
    the multirun folder name (override_dirname) must not show what FREE_TO_CHANGE allows."""
    from mtpc.draft_fields import FREE_TO_CHANGE

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
    assert set(FREE_TO_CHANGE) <= excluded, set(FREE_TO_CHANGE) - excluded


def test_evabyte_keeps_one_document_per_training_row() -> None:
    """EVA attention builds its own masks, so packed documents would see each other
    (scripts/bench_packed_documents.py): model=evabyte turns packing off, the default keeps it."""
    assert _compose("train", ["model=evabyte"]).data.pack_documents is False
    assert _compose("train").data.pack_documents is True


def test_unknown_group_option_lists_allowed_values() -> None:
    with pytest.raises(ConfigCompositionException) as excinfo:
        _compose("train", ["circuit=foo"])
    message = str(excinfo.value) + str(excinfo.value.__cause__)
    assert "circuit" in message and "btree" in message


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        (["circuit.kind=foo"], "circuit.kind", "ff, cp, hmm, btree"),
        (["circuit.window=0"], "circuit.window", "integer >= 1"),
        (["circuit.window=-3"], "circuit.window", "integer >= 1"),
        (["circuit.rank=0"], "circuit.rank", "integer >= 1"),
        (["circuit=ff", "circuit.rank=4"], "circuit.rank", "allowed: 1"),
        (["lora.layers=-1"], "lora.layers", "integer >= 0"),
        (["lora.rank=0"], "lora.rank", "integer >= 1"),
        (["lora.dropout=1.5"], "lora.dropout", "[0.0, 1.0)"),
        (["model.name=gpt2"], "model.name", "tiny, evabyte, llama3_byte"),
        (["model.dtype=int8"], "model.dtype", "float32, bfloat16, float16"),
        (["loss.name=mse"], "loss.name", "nll, kl"),
        (["loss.gamma=1.5"], "loss.gamma", "(0.0, 1.0]"),
        (["stage=lora"], "init_from", "stage=heads"),
        (["stage=both"], "stage", "heads, lora"),
        (["seed=-1"], "seed", "integer >= 0"),
        (["circuit.sum_init_std=-0.1"], "circuit.sum_init_std", "[0.0, inf)"),
        (["circuit.extra_positions=zeros"], "circuit.extra_positions", "repeat_last, random"),
        (["circuit.identity_init=maybe"], "circuit.identity_init", "true, false"),
        (["loss.normalise_discount=2"], "loss.normalise_discount", "true, false"),
        (["optimizer.weight_decay=-1"], "optimizer.weight_decay", "[0.0, inf)"),
        # not a number: the one-line error, not a TypeError from comparing a string
        (["lora.alpha=abc"], "lora.alpha", "a number in (0.0, inf)"),
        (["loss.gamma=high"], "loss.gamma", "a number in (0.0, 1.0]"),
        (["optimizer.betas=[0.9,1.5]"], "optimizer.betas", "two numbers in [0, 1)"),
        (["optimizer.betas=[0.9]"], "optimizer.betas", "two numbers in [0, 1)"),
    ],
)
def test_bad_train_values_name_the_field(overrides: list[str], field: str, allowed: str) -> None:
    cfg = _compose("train", overrides)
    with pytest.raises(ConfigError) as excinfo:
        validate_train_config(cfg)
    assert field in str(excinfo.value)
    assert allowed in str(excinfo.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [(["max_new_tokens=0"], "max_new_tokens"), (["num_prompts=0"], "num_prompts")],
)
def test_bad_eval_values_name_the_field(overrides: list[str], field: str) -> None:
    cfg = _compose("eval", overrides)
    with pytest.raises(ConfigError, match=field):
        parse_eval(cfg)
