#!/usr/bin/env bash
# Refresh requirements.lock: the exact versions (with hashes) of every package MTPC and its
# dev, slurm, sweep and triton extras need on this CPU machine, resolved (on Python 3.11) from
# pyproject.toml's ranges to the newest releases they admit. Run scripts/check_upstream.sh
# first (it tells whether the newest releases pass the tests), then this, then the whole suite
# (bash scripts/test.sh). The hashes cover every wheel of each pinned release, so the one lock
# serves Python 3.11-3.13 (scripts/setup.sh; torch's entry is the cp311 CPU wheel, which
# setup.sh replaces on other Pythons).
#
#   bash scripts/lock.sh                                # everything to the newest admitted
#   bash scripts/lock.sh --upgrade-package triton       # only the named packages move
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck source=scripts/python.sh
. scripts/python.sh
if [ "$(pyver .venv/bin/python)" != 3.11 ]; then  # elsewhere torch==2.13.0 resolves to a CUDA build
  echo "lock.sh: the lock is resolved on Python 3.11 (torch's local CPU wheel); .venv is Python $(pyver .venv/bin/python)" >&2
  exit 1
fi
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" .venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links --extra dev --extra slurm --extra sweep --extra triton \
  "${@:---upgrade}" --output-file requirements.lock pyproject.toml
echo "requirements.lock: $(grep -c '^[a-zA-Z]' requirements.lock) packages pinned"
