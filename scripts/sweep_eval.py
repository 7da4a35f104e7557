"""Evaluates every exported draft under a folder and writes one combined table.

    python scripts/sweep_eval.py outputs/train                 # every */draft (any depth)
    python scripts/sweep_eval.py outputs/train num_prompts=250 num_prompt_sets=3 device=cuda \
        baseline=outputs/train/<ff run>/draft

Extra arguments are ``eval.yaml`` overrides. All drafts go through one ``evaluate`` call, so
they share the prompts, the AR reference and the trade-off plot (paper Fig. 1). The records,
table, results.json/CSV and plots land in the evaluation's own folder
(``outputs/eval/<first draft>+<N>-<mode>-<shape>-<key>``, or ``output_dir=...``); running
the same command again after a crash resumes it. To spread drafts over separate jobs
instead (a SLURM array), evaluate one draft per job and merge the folders without
decoding: ``python eval.py 'report=[outputs/eval/*-greedy-3x250x1024-*]' output_dir=<dir>``
(see docs/EVALUATION.md).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def find_drafts(folder: Path) -> list[Path]:
    """Exported draft folders (a config.json with head.safetensors beside it) under ``folder``."""
    return sorted(
        p.parent for p in folder.rglob("config.json") if (p.parent / "head.safetensors").is_file()
    )


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        raise SystemExit(2)
    folder = Path(sys.argv[1])
    drafts = find_drafts(folder)
    if not drafts:
        raise SystemExit(f"no exported drafts (config.json + head.safetensors) under {folder}")
    from hydra import compose, initialize_config_dir

    from mtpc.errors import run_reporting_user_errors
    from mtpc.evaluation.run import evaluate

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    overrides = sys.argv[2:]
    listing = ",".join(f"'{d}'" for d in drafts)
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"draft=[{listing}]", *overrides])
    run_reporting_user_errors(lambda: evaluate(cfg))


if __name__ == "__main__":
    main()
