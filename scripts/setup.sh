#!/usr/bin/env bash
# Idempotent environment setup: a virtualenv in .venv with MTPC and its dev extras.
# torch is pinned (torch==2.13.0) so a CPU machine keeps its CPU build.
# Re-running is cheap: pip runs again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.mtpc-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,slurm,sweep]'
  echo "$want" > "$stamp"
fi
