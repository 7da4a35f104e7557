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

    def run() -> None:
        check_draft_folders(cfg)
        evaluate(cfg)

    run_reporting_user_errors(run, also=(FileNotFoundError,))


def check_draft_folders(cfg: DictConfig) -> None:
    """Refuses a ``draft=`` / ``baseline=`` that is a training run folder, naming its draft.

    Raises:
        DraftError: the folder has no ``config.json`` but holds ``draft/config.json``.
    """
    from mtpc.errors import DraftError
    from mtpc.export import CONFIG_NAME

    root = Path(str(cfg.paths.root_dir)) if cfg.get("paths") else Path.cwd()
    for key in ("draft", "baseline"):
        value = cfg.get(key)
        if value is None:
            continue
        for given in [value] if isinstance(value, str) else list(value):
            path = Path(str(given))
            path = path if path.is_absolute() else root / path
            if not (path / CONFIG_NAME).is_file() and (path / "draft" / CONFIG_NAME).is_file():
                raise DraftError(
                    f"{key}={given} is a training run folder, not an exported draft; "
                    f"use {key}={Path(str(given)) / 'draft'}"
                )


if __name__ == "__main__":
    main()
