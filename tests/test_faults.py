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
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*FAST, *overrides], return_hydra_config=False)
    with open_dict(cfg):
        cfg.paths.root_dir = str(tmp_path)
        cfg.paths.cache_dir = str(tmp_path / "cache")
        cfg.paths.output_dir = str(tmp_path / name)
        cfg.run_dir = str(tmp_path / name)
    return cfg


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

    from mtpc.data.cache import CacheCorruptError, load_prepared

    cfg = _compose(tmp_path, [])
    module = instantiate(cfg.data)
    module.setup()
    folder = module.data.folder
    ids = np.fromfile(folder / "ids.u16", dtype="<u2")
    good = ids.copy()
    ids[:] = 65 + 64  # in range ('A'), same size: trained "normally" before
    ids.tofile(folder / "ids.u16")
    with pytest.raises(CacheCorruptError, match=rf"{folder}.*ids\.u16"):
        load_prepared(folder)
    with caplog.at_level(logging.WARNING):
        rebuilt = instantiate(cfg.data)
        rebuilt.setup()
    assert "rebuilding" in caplog.text and str(folder) in caplog.text
    assert np.array_equal(np.asarray(rebuilt.data.ids), good)

    (folder / "offsets.npy").write_bytes(b"garbage")  # truncated: was a raw numpy/pickle error
    with pytest.raises(CacheCorruptError, match=rf"{folder}.*offsets\.npy"):
        load_prepared(folder)
