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
    """Evaluates; a user's mistake prints one or two lines and exits with status 2.

    ``HYDRA_FULL_ERROR=1`` shows the full traceback of those too; bugs always show it.
    """
    from mtpc.errors import run_reporting_user_errors
    from mtpc.evaluation.run import evaluate

    run_reporting_user_errors(lambda: evaluate(cfg), also=(FileNotFoundError,))


if __name__ == "__main__":
    main()
