#!/usr/bin/env bash
# Idempotent environment setup: a virtualenv in .venv with exactly the packages of
# requirements.lock (every dependency, transitive ones included, pinned with hashes; torch's
# CPU build torch==2.13.0+cpu), then MTPC itself in editable mode without resolving anything.
# A fresh clone thus gets the environment the tests passed in. Re-running is cheap: pip runs
# again only when requirements.lock, pyproject.toml, the Python or MTPC_TORCH_INDEX changed.
#
# The interpreter: $PYTHON if set, else python3.11, else python3; Python 3.11, 3.12 or 3.13.
# The lock's hashes cover every wheel of each pinned release, except torch's: its entry is the
# cp311 CPU wheel. So on Python 3.12/3.13, or with MTPC_TORCH_INDEX set, torch==2.13.0 comes
# from elsewhere, resolved by pip with its own dependencies (not hash-pinned), and every other
# package from the lock, same pins and hashes:
#   PYTHON=python3.12 bash scripts/setup.sh            # torch 2.13.0 from the default index
#                                                      # (PyPI: the CUDA 13.0 build; .venv 5.7 GB)
#   MTPC_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   # a GPU
#   MTPC_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh     # CPU build
# A CUDA torch pins its own triton (2.13.0: triton==3.7.1); then the lock's triton (3.9.0, for
# the interpreter tests on CPU) is skipped so that torch keeps the one it was built with.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python.sh
. scripts/python.sh
TORCH_INDEX="${MTPC_TORCH_INDEX:-}"

if [ ! -x .venv/bin/python ] || [ -n "${PYTHON:-}" ]; then
  PYTHON=$(pick_python)
fi
if [ -x .venv/bin/python ] && [ -n "${PYTHON:-}" ] && [ "$(pyver .venv/bin/python)" != "$(pyver "$PYTHON")" ]; then
  echo "setup.sh: .venv is Python $(pyver .venv/bin/python), PYTHON=$PYTHON is $(pyver "$PYTHON"); remove .venv to rebuild it" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  err=$(mktemp)
  if ! "$PYTHON" -m venv .venv >/dev/null 2>"$err"; then
    rm -rf .venv
    echo "setup.sh: '$PYTHON -m venv .venv' failed ($(tail -n 1 "$err"); Debian/Ubuntu: apt install python$(pyver "$PYTHON")-venv)" >&2
    exit 1
  fi
  rm -f "$err"
fi
ver=$(pyver .venv/bin/python)

stamp=.venv/.mtpc-installed
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)-py${ver}-${TORCH_INDEX}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  lock=requirements.lock
  if [ -n "$TORCH_INDEX" ] || [ "$ver" != 3.11 ]; then
    if [ -n "$TORCH_INDEX" ]; then
      .venv/bin/python -m pip install --quiet torch==2.13.0 --index-url "$TORCH_INDEX"
    else
      echo "setup.sh: Python $ver: torch==2.13.0 from the default index (the lock's torch is the cp311 CPU wheel; MTPC_TORCH_INDEX picks another)"
      .venv/bin/python -m pip install --quiet torch==2.13.0
    fi
    # Skip the lock's torch entry (its hash is the cp311 CPU wheel's) and, where this torch
    # requires a triton of its own, the lock's triton too.
    skip='^torch=='
    if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(not any(r.split(';')[0].strip().startswith('triton') and 'extra ==' not in r for r in m.requires('torch') or []))"; then
      skip='^(torch|triton)=='
    fi
    lock=.venv/requirements-lock-rest.lock
    awk -v skip="$skip" '$0 ~ skip {s=1; next} s && /^[ \t]/ {next} {s=0; print}' requirements.lock > "$lock"
  fi
  .venv/bin/python -m pip install --quiet --require-hashes --no-deps -r "$lock"
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  .venv/bin/python -m pip check
  echo "$want" > "$stamp"
fi
