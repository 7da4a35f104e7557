"""Faults and bad input (issue 13): silent data loss, run folders, caches, checkpoints, drafts.

Each test reproduces one failure of the issue on the tiny target with a few steps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from tests.helpers import compose_train_cfg

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
FAST = [
    "data.num_rows=200",
    "data.seq_len=96",
    "data.batch_size=4",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.limit_val_batches=1",
    "loss.chunk_size=128",
    "circuit=cp",
    "circuit.window=2",
    "circuit.rank=2",
    "logger=csv",
]


def _compose(tmp_path: Path, overrides: list[str], name: str = "run") -> DictConfig:
    return compose_train_cfg(tmp_path, overrides, name, fast=FAST)


def _chat_rows(path: Path, count: int) -> Path:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    line = json.dumps(row) + "\n"
    path.write_text(line * count)
    return path


# -- 1: a local dataset is read whole unless the user limits it ---------------------------


def test_local_dataset_is_not_cut_to_the_synthetic_row_count(tmp_path: Path, caplog) -> None:
    data = _chat_rows(tmp_path / "big.jsonl", 20_001)
    cfg = _compose(tmp_path, [f"data.path={data}"])
    with open_dict(cfg):
        cfg.data.num_rows = None  # FAST limits the synthetic rows; the default is what matters
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        default = compose("train", overrides=[f"data.path={data}"])
    assert default.data.num_rows is None
    module = instantiate(default.data, cache_dir=str(tmp_path / "cache"))
    source = module.row_source()
    assert source.row_limit is None
    assert sum(1 for _ in source) == 20_001  # was 20000: the synthetic default's num_rows

    limited = instantiate(cfg.data, num_rows=7, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        limited.setup()
    assert limited.summary["rows_seen"] == 7 and limited.summary["row_limit"] == 7
    assert "first 7 rows" in caplog.text and "data.num_rows=7" in caplog.text


# -- 3: the data cache is checked against the hashes written with it -----------------------


def test_a_corrupt_data_cache_is_detected_and_rebuilt(tmp_path: Path, caplog) -> None:
    import numpy as np

    from mtpc.data.cache import load_prepared

    cfg = _compose(tmp_path, [])
    module = instantiate(cfg.data)
    module.setup()
    folder = module.data.folder
    ids = np.fromfile(folder / "ids.u16", dtype="<u2")
    good = ids.copy()
    ids[:] = 65 + 64  # in range ('A'), same size: trained "normally" before
    ids.tofile(folder / "ids.u16")
    with pytest.raises(Exception, match=rf"{folder}.*ids\.u16") as err:
        load_prepared(folder)  # was: read silently (validation loss 63.7 instead of 2.75)
    assert type(err.value).__name__ == "CacheCorruptError"
    with caplog.at_level(logging.WARNING):
        rebuilt = instantiate(cfg.data)
        rebuilt.setup()
    assert "rebuilding" in caplog.text and str(folder) in caplog.text
    assert np.array_equal(np.asarray(rebuilt.data.ids), good)

    (folder / "offsets.npy").write_bytes(b"garbage")  # truncated: was a raw numpy/pickle error
    with pytest.raises(Exception, match=rf"{folder}.*offsets\.npy"):
        load_prepared(folder)


# -- 2: one run per folder: a lock, and a config check on resume ---------------------------


def test_a_second_run_on_a_busy_run_folder_is_refused(tmp_path: Path) -> None:
    import fcntl

    from mtpc.training.run import train

    cfg = _compose(tmp_path, ["trainer.max_steps=1", "validate_before_training=false"])
    (tmp_path / "run").mkdir()
    with (tmp_path / "run" / ".lock").open("w") as running:  # what a running job holds
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(Exception, match=rf"run folder {tmp_path / 'run'} is in use") as err:
            train(cfg)  # was: a second run interleaving metrics.csv and checkpoints
    assert type(err.value).__name__ == "RunFolderBusyError"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_with_changed_settings_is_refused_naming_the_fields(tmp_path: Path) -> None:
    import torch

    from mtpc.training.run import train

    common = ["callbacks.checkpoint_every_n_steps=1", "validate_before_training=false",
              "export=false"]  # fmt: skip
    train(_compose(tmp_path, [*common, "trainer.max_steps=2"]))
    changed = _compose(tmp_path, [*common, "trainer.max_steps=3", "optimizer.lr=0.01"])
    with pytest.raises(Exception, match=r"optimizer\.lr: [0-9.e-]+ -> 0\.01") as err:
        train(changed)  # was: resumed silently at the checkpoint's lr
    assert "allow_resume_changes=true" in str(err.value) and "run_name=" in str(err.value)
    # a longer budget is not a change that matters
    train(_compose(tmp_path, [*common, "trainer.max_steps=3"]))
    # the explicit override resumes with the new learning rate
    train(_compose(tmp_path, [*common, "trainer.max_steps=4", "optimizer.lr=0.01",
                              "allow_resume_changes=true"]))  # fmt: skip
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4
    assert last["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.01)


def test_a_run_that_ended_at_its_epoch_budget_says_how_to_take_more_steps(tmp_path: Path) -> None:
    """An epoch-end checkpoint resumes into no step at all, whatever trainer.max_steps says:
    was a silent re-export of the same draft; now one error naming trainer.max_epochs."""
    from mtpc.errors import UserError
    from mtpc.training.run import train

    common = ["trainer.limit_train_batches=3", "validate_before_training=false",
              "export=false", "trainer.max_epochs=1"]  # fmt: skip
    assert train(_compose(tmp_path, [*common, "trainer.max_steps=5"]))["train/steps"] == 3
    with pytest.raises(
        UserError, match=r"trainer\.max_epochs=1 \(step 3\).*trainer\.max_epochs=-1"
    ):
        train(_compose(tmp_path, [*common, "trainer.max_steps=6"]))
    more = [*common[:-1], "trainer.max_epochs=-1", "trainer.max_steps=6"]
    assert train(_compose(tmp_path, more))["train/steps"] == 6  # the fix the message names
    # the same budget again is a finished run, not an error
    assert train(_compose(tmp_path, more))["train/steps"] == 6


# -- 6: a truncated last.ckpt falls back to the newest readable checkpoint ---------------


def test_truncated_last_checkpoint_falls_back_to_a_readable_one(tmp_path: Path, caplog) -> None:
    from mtpc.training.run import train

    common = ["callbacks.checkpoint_every_n_steps=1", "trainer.val_check_interval=1",
              "validate_before_training=false", "export=false"]  # fmt: skip
    train(_compose(tmp_path, [*common, "trainer.max_steps=2"]))
    checkpoints = tmp_path / "run" / "checkpoints"
    (best,) = checkpoints.glob("best-*.ckpt")
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # killed mid-copy
    stray = checkpoints / ".last.ckpt.tmp-999999999"
    stray.write_bytes(b"partial")
    with caplog.at_level(logging.WARNING):
        resumed = train(_compose(tmp_path, [*common, "trainer.max_steps=3"]))
    assert "unreadable" in caplog.text and best.name in caplog.text  # was: a raw torch error
    assert resumed["train/steps"] == 3 and not stray.exists()
    assert sorted(p.name for p in checkpoints.glob("last*.ckpt")) == ["last.ckpt"]  # no last-v1

    for ckpt in checkpoints.glob("*.ckpt"):
        ckpt.write_bytes(b"truncated")
    with pytest.raises(Exception, match=rf"{checkpoints / 'last.ckpt'} is unreadable"):
        train(_compose(tmp_path, [*common, "trainer.max_steps=4"]))


# -- 13: a resumed run reports the untrained draft of its start, not nothing ---------------


def test_a_resumed_run_keeps_its_init_metrics(tmp_path: Path) -> None:
    from mtpc.training.run import train

    common = ["callbacks.checkpoint_every_n_steps=1"]
    first = train(_compose(tmp_path, [*common, "trainer.max_steps=2"]))
    resumed = train(_compose(tmp_path, [*common, "trainer.max_steps=3"]))
    assert resumed["train/steps"] == 3
    # was: the resumed run's metrics.json and model card had no init/ metrics at all
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["init/val/loss"] == pytest.approx(first["init/val/loss"])
    card = (tmp_path / "run" / "draft" / "README.md").read_text()
    assert f"| init/val/loss | {first['init/val/loss']} |" in card


# -- 5 and 9: wrong metadata and corrupt drafts are refused, naming the file ---------------


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    from mtpc.model import MTPCModel

    folder = tmp_path_factory.mktemp("draft") / "draft"
    MTPCModel.from_config("tiny", kind="cp", window=2, rank=2).save_pretrained(folder)
    return folder


def _copy(draft: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(draft, tmp_path / "draft"))


def test_a_draft_naming_another_codec_is_refused(tiny_draft: Path, tmp_path: Path) -> None:
    from mtpc.model import MTPCModel

    draft = _copy(tiny_draft, tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config["codec"] = "llama3_byte"  # was: prompts encoded in the wrong codec
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"codec 'llama3_byte'.*target.*codec 'tiny'"):
        MTPCModel.from_pretrained(draft)


def test_non_finite_head_weights_are_refused_on_load(tiny_draft: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from mtpc.model import MTPCModel

    draft = _copy(tiny_draft, tmp_path)
    state = load_file(draft / "head.safetensors")
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")  # was: loaded silently
    save_file(state, draft / "head.safetensors")
    with pytest.raises(ValueError, match=rf"head\.safetensors: tensor '{name}' holds NaN"):
        MTPCModel.from_pretrained(draft)


def test_a_corrupt_head_file_error_names_the_file(tiny_draft: Path, tmp_path: Path) -> None:
    from mtpc.export import read_config
    from mtpc.model import MTPCModel

    draft = _copy(tiny_draft, tmp_path)
    head = draft / "head.safetensors"
    head.write_bytes(head.read_bytes()[:100])  # was: safetensors' error without a file name
    with pytest.raises(ValueError, match=rf"{head} is not a readable safetensors file"):
        MTPCModel.from_pretrained(draft)
    with pytest.raises(ValueError, match=rf"use draft={draft}"):
        read_config(tmp_path)  # the run folder instead of its draft/


def test_zero_steps_is_refused_and_never_repoints_last_draft(tmp_path: Path) -> None:
    from mtpc.config import ConfigError
    from mtpc.training.run import train

    with pytest.raises(ConfigError, match=r"trainer\.max_steps=0"):
        train(_compose(tmp_path, ["trainer.max_steps=0"]))  # was: exported an untrained draft
    assert not (tmp_path / "outputs" / "last_draft.txt").exists()
    assert not (tmp_path / "run" / "draft").exists()
