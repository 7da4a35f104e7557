#!/usr/bin/env bash
# Refresh requirements.lock: the exact versions (with hashes) of every package MTPC and its
# dev, slurm and sweep extras need on this CPU machine, resolved from pyproject.toml's ranges
# to the newest releases they admit. Run scripts/check_upstream.sh first (it tells whether the
# newest releases pass the tests), then this, then the whole suite (bash scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" .venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links --extra dev --extra slurm --extra sweep \
  --upgrade --output-file requirements.lock pyproject.toml
echo "requirements.lock: $(grep -c '^[a-zA-Z]' requirements.lock) packages pinned"
