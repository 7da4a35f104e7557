#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, offline, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
.venv/bin/python -m pytest -q "$@"
