"""Evaluate exported drafts against autoregressive decoding: ``python eval.py [overrides]``.

Examples:
    python eval.py                                     # the draft `python train.py` made last
    python eval.py draft=outputs/train/<run>/draft baseline=<ff draft dir>
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from mtpc.evaluation.run import evaluate

    evaluate(cfg)


if __name__ == "__main__":
    main()
