#!/usr/bin/env bash
# Drift check: does MTPC still work with the newest releases pyproject.toml admits?
#
# Builds a throwaway virtualenv from pyproject.toml's ranges (no lock), prints which packages
# differ from requirements.lock, then runs the quick tests and, where the real remote code is
# at hand, the real-code conformance checks (scripts/check_remote_code.py) in it. Prints what
# failed; exits 0 only when everything passed. Run it before refreshing the lock
# (bash scripts/lock.sh), and whenever a dependency released (transformers above all).
#
#   bash scripts/check_upstream.sh                         # the newest releases admitted
#   bash scripts/check_upstream.sh transformers==5.23.0    # pin some packages (older too)
#   EVABYTE_CODE=<dir with evabyte_hf/*.py> TOKENKIT_CODE=<dir with tokenkit/hf/*.py> \
#     bash scripts/check_upstream.sh                       # + the real-code conformance
#   MTPC_UPSTREAM_PYTEST="-m 'not slow' -k decoding" bash scripts/check_upstream.sh
#   MTPC_UPSTREAM_KEEP=1 ...                               # keep the venv (path printed)
#   PYTHON=python3.13 bash scripts/check_upstream.sh       # another Python (3.11-3.13)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python.sh
. scripts/python.sh
PYTHON=$(pick_python) || exit 1  # $PYTHON, else python3.11, else python3 (3.11-3.13)
venv=$(mktemp -d "${TMPDIR:-/tmp}/mtpc-upstream.XXXXXX")
[ -n "${MTPC_UPSTREAM_KEEP:-}" ] || trap 'rm -rf "$venv"' EXIT
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
failed=()

echo "== building $venv from pyproject.toml's ranges ${*:+(pinned: $*)}"
"$PYTHON" -m venv "$venv"
# torch stays torch==2.13.0 (pyproject pins it: a range would pull a CUDA build; on Python
# 3.12/3.13 it is the CUDA build anyway, the CPU wheel here being cp311's, with its own triton)
if ! "$venv/bin/python" -m pip install --quiet --upgrade -e '.[dev,slurm,sweep,triton]' "$@"; then
  echo "FAIL install: pip could not resolve pyproject.toml's ranges ${*:+with $*}"
  exit 1
fi

echo "== packages that differ from requirements.lock (lock -> newest)"
"$venv/bin/python" - <<'EOF'
import re
from importlib import metadata
lock = {}
for line in open("requirements.lock"):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
    if m:
        lock[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
seen = {}
for dist in metadata.distributions():
    seen[re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()] = dist.version
rows = [(n, lock.get(n, "-"), seen.get(n, "-")) for n in sorted(set(lock) | set(seen))]
rows = [r for r in rows if r[1] != r[2] and r[0] not in ("mtpc", "pip", "setuptools", "wheel")]
for name, old, new in rows:
    print(f"  {name:32s} {old:>14s} -> {new}")
print(f"  ({len(rows)} differ)" if rows else "  (none: the lock is current)")
EOF

echo "== quick tests"
pytest_args=${MTPC_UPSTREAM_PYTEST:-"-m 'not slow'"}
if eval "\"$venv/bin/python\" -m pytest -q -p no:cacheprovider $pytest_args" > "$venv/pytest.log" 2>&1; then
  tail -n 1 "$venv/pytest.log"
else
  grep -E "^(FAILED|ERROR)" "$venv/pytest.log" | head -n 40
  tail -n 1 "$venv/pytest.log"
  failed+=("quick tests")
fi

echo "== real-code conformance (scripts/check_remote_code.py)"
run_conformance() {  # kind, code dir, extra args
  local kind=$1 code=$2; shift 2
  if "$venv/bin/python" scripts/check_remote_code.py "$kind" "$code" "$@" > "$venv/$kind.json" 2> "$venv/$kind.err"; then
    echo "  PASS $kind $*"
  else
    echo "  FAIL $kind $*: $(grep -v -i warn "$venv/$kind.err" | tail -n 1)"
    failed+=("conformance $kind $*")
  fi
}
if [ -n "${EVABYTE_CODE:-}" ]; then run_conformance evabyte "$EVABYTE_CODE"; else echo "  SKIP evabyte: set EVABYTE_CODE=<dir with evabyte_hf/*.py>"; fi
if [ -n "${TOKENKIT_CODE:-}" ]; then
  for rope in llama3 default; do run_conformance llama3_byte "$TOKENKIT_CODE" --rope "$rope"; done
else
  echo "  SKIP llama3_byte: set TOKENKIT_CODE=<dir with tokenkit/hf/*.py>"
fi

if [ ${#failed[@]} -eq 0 ]; then
  echo "== upstream OK: ${*:-the newest releases} pass${*:+ (not the lock: refresh it only from the newest)}; refresh the lock with: bash scripts/lock.sh"
  exit 0
fi
echo "== upstream drift: failed: ${failed[*]} (logs in $venv; MTPC_UPSTREAM_KEEP=1 keeps them)"
exit 1
