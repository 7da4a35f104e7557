#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, offline, on CPU, in parallel
# (pytest-xdist, one worker per core, each test file on one worker so its module fixtures are
# built once; MTPC_TEST_WORKERS=0 runs in one process) with a per-test timeout (pyproject).
# Extra arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the quick loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
.venv/bin/python -m pytest -q -n "${MTPC_TEST_WORKERS:-auto}" --dist loadfile --durations=10 "$@"
