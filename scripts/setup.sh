#!/usr/bin/env bash
# Idempotent environment setup: a virtualenv in .venv with exactly the packages of
# requirements.lock (every dependency, transitive ones included, pinned with hashes; torch's
# CPU build torch==2.13.0+cpu), then MTPC itself in editable mode without resolving anything.
# A fresh clone thus gets the environment the tests passed in. Re-running is cheap: pip runs
# again only when requirements.lock or pyproject.toml changed.
#
# GPU machines: MTPC_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
# installs torch==2.13.0 from that index (the CUDA build; triton with it) and every other
# package from the lock, with the same pins and hashes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
TORCH_INDEX="${MTPC_TORCH_INDEX:-}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.mtpc-installed
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)-${TORCH_INDEX}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  lock=requirements.lock
  if [ -n "$TORCH_INDEX" ]; then
    .venv/bin/python -m pip install --quiet torch==2.13.0 --index-url "$TORCH_INDEX"
    lock=.venv/requirements-no-torch.lock  # the lock without torch's entry (its hash is the CPU wheel's)
    awk '/^torch==/{skip=1; next} skip && /^[ \t]/{next} {skip=0; print}' requirements.lock > "$lock"
  fi
  .venv/bin/python -m pip install --quiet --require-hashes --no-deps -r "$lock"
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  .venv/bin/python -m pip check
  echo "$want" > "$stamp"
fi
