#!/usr/bin/env bash
# The embedded default, end to end on CPU: set up, train the default draft on the bundled
# tiny target and synthetic chat data, then evaluate it against autoregressive decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
if [ -f train.py ] && .venv/bin/python -c "import mtpc.training" 2>/dev/null; then
  .venv/bin/python train.py "$@"
fi
.venv/bin/python eval.py
