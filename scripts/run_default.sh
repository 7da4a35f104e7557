#!/usr/bin/env bash
# The embedded default, end to end on CPU: set up, train the default draft (MTPC-BTree,
# n = 8, r = 8) on the bundled tiny target and synthetic chat data, then evaluate it against
# autoregressive decoding of the same target and print the table. Extra arguments go to
# train.py (e.g. `bash scripts/run_default.sh circuit=cp`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
.venv/bin/python train.py trainer.enable_progress_bar=false "$@"
.venv/bin/python eval.py
