"""Errors a person can read (issue 13, items 7, 8, 9): no traceback for a user's mistake.

The command-line tests run ``train.py`` / ``eval.py`` in a subprocess and fail before any
model or data is loaded, so each takes a few seconds (the imports).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    environ.pop("HYDRA_FULL_ERROR", None)
    environ.update(env)
    command = [sys.executable, str(REPO / script), *args, f"hydra.run.dir={tmp_path / 'out'}"]
    return subprocess.run(command, env=environ, cwd=tmp_path, capture_output=True, text=True)


@pytest.mark.slow
def test_user_errors_print_one_or_two_lines_without_a_traceback(tmp_path: Path) -> None:
    bad = _run("train.py", ["circuit=ff", "circuit.rank=4"], tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr  # was: Hydra's "Error executing job" + traceback
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2 and "circuit.rank=4" in lines[-1], bad.stderr

    # the same mistake with HYDRA_FULL_ERROR=1 keeps the whole trace
    full = _run("train.py", ["circuit=ff", "circuit.rank=4"], tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "Traceback" in full.stderr and "ConfigError" in full.stderr

    # eval.py: a training run folder given as draft= names its draft/ folder
    run_dir = tmp_path / "outputs" / "train" / "myrun"
    (run_dir / "draft").mkdir(parents=True)
    (run_dir / "draft" / "config.json").write_text("{}")
    wrong = _run("eval.py", [f"draft={run_dir}"], tmp_path)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]
    assert f"draft={run_dir / 'draft'}" in wrong.stderr

    missing = _run("eval.py", [f"draft={tmp_path / 'nope'}"], tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "nope" in missing.stderr


def test_a_bug_keeps_its_traceback() -> None:
    from mtpc.errors import run_reporting_user_errors

    def bug() -> None:
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_reporting_user_errors(bug, also=(FileNotFoundError,))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=0", r"optimizer\.lr=0 is not allowed; allowed: a number > 0"),
        ("optimizer.lr=fast", r"optimizer\.lr='fast' is not allowed"),
        ("trainer.max_steps=-2", r"trainer\.max_steps=-2 is not allowed; allowed: an integer >= 1"),
        ("callbacks.checkpoint_every_n_steps=0", r"callbacks\.checkpoint_every_n_steps=0"),
        ("model.path=/no/such/model", r"model\.path='/no/such/model' does not exist"),
    ],
)
def test_bad_settings_fail_at_startup(override: str, message: str) -> None:
    from hydra import compose, initialize_config_dir

    from mtpc.config import ConfigError
    from mtpc.training.settings import validate_train_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[override])
    with pytest.raises(ConfigError, match=message):
        validate_train_config(cfg)  # was: accepted, failing a minute later in torch's words


def test_a_head_too_big_for_memory_is_refused_with_the_numbers(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mtpc.config import ConfigError
    from mtpc.training.run import train

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["circuit.rank=1000000", "logger=none"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "run")
        cfg.paths.cache_dir = str(tmp_path / "cache")
    with pytest.raises(
        ConfigError, match=r"needs about [\d.]+ GiB.*8\*1000000\*320\*128.*GiB free"
    ):
        train(cfg)  # was: the allocator asked for 1.3 TB
    assert not (tmp_path / "cache").exists()  # before data preparation


@pytest.mark.slow
def test_the_two_remaining_tracebacks_are_one_line_at_the_command_line(tmp_path: Path) -> None:
    """Issue 19: both raised a ValueError from below the startup check (a traceback)."""
    lora = _run("train.py", ["lora.layers=999", "logger=none"], tmp_path)
    assert lora.returncode == 2 and "Traceback" not in lora.stderr, lora.stderr[-2000:]
    errors = [line for line in lora.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["error: lora.layers (k) is 999; allowed: 0..4 (the layer count) (model=tiny)"]
    assert lora.stderr.rstrip().endswith(errors[0])  # before it: Lightning's INFO lines only
    from mtpc.model import MTPCModel

    draft = tmp_path / "draft"
    MTPCModel.from_config("tiny", kind="cp", window=2, rank=2).save_pretrained(draft)
    sampling = _run("eval.py", [f"draft={draft}", "greedy=false", "drafting=map"], tmp_path)
    assert sampling.returncode == 2 and "Traceback" not in sampling.stderr, sampling.stderr[-2000:]
    lines = [line for line in sampling.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "drafting='map' is not allowed with greedy=false" in lines[0]


BAD_TRAINING = [
    ("lora.layers=999", r"lora\.layers \(k\) is 999; allowed: 0\.\.4"),
    ("lora.layers=1 lora.target_modules=[foo]", r"lora\.target_modules \['foo'\] do not exist"),
    ("+circuit.head_init=bad", r"circuit\.head_init='bad' is not allowed; allowed: pretrained"),
    ("scheduler=bad", r"scheduler='bad' is not allowed"),
    ("global_batch_size=0", r"global_batch_size=0 is not allowed"),
    ("trainer.devices=0", r"trainer settings refused by Lightning: .*devices=0"),
    ("trainer.precision=bad", r"trainer settings refused by Lightning: Precision 'bad'"),
    (
        "trainer=ddp_cpu trainer.strategy=fsdp",
        r"refused by Lightning: The strategy `fsdp` requires a GPU",
    ),
    ("+trainer.bogus=1", r"trainer settings refused by Lightning: .*'bogus'"),
    ("loss.gamma=2", r"loss\.gamma=2 is not allowed"),
    ("data.source=nope", r"data source is 'nope'"),
    pytest.param(
        "trainer=fsdp",
        r"trainer\.accelerator=gpu needs CUDA GPUs and this machine has none",
        marks=pytest.mark.skipif("__import__('torch').cuda.is_available()"),
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_TRAINING)
def test_each_bad_training_value_is_a_user_error(overrides: str, message: str, tmp_path) -> None:
    """Every check found in the audit: a UserError (one line, exit 2), never a bare ValueError."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mtpc.errors import UserError
    from mtpc.training.run import train

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["logger=none", *overrides.split()])
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "run")
        cfg.paths.root_dir = str(tmp_path)
        cfg.paths.cache_dir = str(tmp_path / "cache")
    with pytest.raises(UserError, match=message):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


BAD_EVALUATION = [
    ("greedy=false drafting=map", r"drafting='map' is not allowed with greedy=false"),
    ("greedy=false drafting=chain", r"drafting='chain' is not allowed with greedy=false"),
    ("drafting=beam", r"drafting='beam' is not allowed; allowed: path, map, chain, tree"),
    ("drafting=tree tree_budget=4", r"drafting=tree is not allowed in an evaluation"),
    ("proposal=marginal", r"proposal='marginal' is not allowed with greedy=true"),
    ("greedy=false proposal=best", r"proposal='best' is not allowed; allowed: path, first_"),
    ("tree_floor=0.1", r"tree_floor=0.1 is not allowed without tree_budget"),
    ("drafter=hetero drafter.algorithm=foo", r"drafter\.algorithm='foo' is not allowed"),
    ("drafter=hetero drafter.psi=bad", r"drafter\.psi='bad' is not allowed"),
    ("drafter=hetero drafter.lookahead=0", r"drafter\.lookahead=0 is not allowed"),
    ("drafter=hetero drafter.look_behind=-1", r"drafter\.look_behind=-1 is not allowed"),
    ("drafter=hetero drafter.model=fixture:nope", r"drafter\.model='fixture:nope'"),
    ("drafter=hetero drafter.model=/no/such/lm", r"drafter\.model='/no/such/lm' does not exist"),
    ("policy=bad", r"policy='bad' is not allowed"),
    ("top_p=2", r"top_p=2 is not allowed"),
    ("resume=bad", r"resume='bad' is not allowed"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_EVALUATION)
def test_each_bad_evaluation_value_is_a_user_error(overrides: str, message: str) -> None:
    from hydra import compose, initialize_config_dir

    from mtpc.errors import UserError
    from mtpc.evaluation.settings import parse_eval

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=overrides.split())
    with pytest.raises(UserError, match=message):
        parse_eval(cfg)  # evaluate() calls it before any draft or prompt is loaded


@pytest.mark.parametrize("proposal", ["path", "first_marginal", "marginal"])
def test_every_sampling_proposal_passes_the_evaluation_check(proposal: str) -> None:
    """The startup check and the decoder agree on which proposals sampling verifies."""
    from hydra import compose, initialize_config_dir

    from mtpc.evaluation.settings import parse_eval

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=["greedy=false", f"proposal={proposal}"])
    parse_eval(cfg)


def test_the_old_draft_mode_is_an_unknown_key() -> None:
    """``draft_mode`` is gone: Hydra refuses it as it refuses any key eval.yaml lacks."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for config in ("eval", "regenerate"):
            with pytest.raises(ConfigCompositionException, match="Could not override 'draft_mode'"):
                compose(config, overrides=["draft_mode=map"])
