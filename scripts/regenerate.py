"""Sequence-level self-distillation: the target rewrites the training rows' assistant turns.

    python scripts/regenerate.py data.num_rows=24 max_new_tokens=96 greedy=true output_dir=DIR
    python scripts/regenerate.py draft=outputs/train/<run>/draft output_dir=DIR   # speculative
    python scripts/regenerate.py greedy=false temperature=1.0 output_dir=DIR       # sampled
    python scripts/regenerate.py shard=0 num_shards=4 output_dir=DIR               # one of 4 shards
    python train.py data.path=DIR                                                  # train on it

Configured by ``configs/regenerate.yaml`` (the ``model`` and ``data`` groups of train.py);
``mtpc.regeneration`` does the work and documents the output folder. Rerunning the same
command resumes after a kill; a user's mistake prints one line and exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="regenerate")
def main(cfg: DictConfig) -> None:
    from mtpc.errors import run_reporting_user_errors
    from mtpc.regeneration import regenerate

    run_reporting_user_errors(lambda: regenerate(cfg), also=(FileNotFoundError,))


if __name__ == "__main__":
    main()
