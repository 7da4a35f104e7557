"""Train an MTPC draft head: ``python train.py [overrides]`` (see configs/train.yaml).

Examples:
    python train.py                                    # embedded default: tiny target, CPU
    python train.py model=evabyte circuit=btree circuit.window=16 lora.layers=1
    python train.py -m circuit=ff,cp,hmm,btree circuit.window=8,16
    python train.py experiment=evabyte_btree_n16_r32   # one row of the paper's tables
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Trains; a user's mistake prints one or two lines and exits with status 2.

    ``HYDRA_FULL_ERROR=1`` shows the full traceback of those too; bugs always show it.
    """
    from mtpc.errors import run_reporting_user_errors
    from mtpc.training.run import train

    def run() -> float | None:
        metrics = train(cfg)
        # A sweeper (optuna) minimises the metric the config names.
        metric_name = cfg.get("optimized_metric")
        return metrics.get(metric_name) if metric_name else None

    return run_reporting_user_errors(run, also=(FileNotFoundError,))


if __name__ == "__main__":
    main()
