# Sourced by scripts/setup.sh and scripts/check_upstream.sh: which Python MTPC runs on.
# pick_python prints the interpreter to build a venv with: $PYTHON if set, else python3.11,
# else python3; or, when that is not Python 3.11, 3.12 or 3.13, fails with one line.
SUPPORTED_PYTHONS="Python 3.11, 3.12 or 3.13"

pyver() {  # "3.12" for an interpreter that runs, "" otherwise (a pyenv shim may not run)
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

describe_python() { if [ -n "$1" ]; then echo "Python $1"; else echo "not a runnable Python"; fi; }

supported_python() { case "$1" in 3.11 | 3.12 | 3.13) return 0 ;; *) return 1 ;; esac; }

pick_python() {
  local ver
  if [ -n "${PYTHON:-}" ]; then
    ver=$(pyver "$PYTHON")
    if ! supported_python "$ver"; then
      echo "$0: PYTHON=$PYTHON is $(describe_python "$ver"); MTPC needs $SUPPORTED_PYTHONS" >&2
      return 1
    fi
    echo "$PYTHON"
  elif [ "$(pyver python3.11)" = 3.11 ]; then
    echo python3.11
  elif supported_python "$(pyver python3)"; then
    echo python3
  else
    echo "$0: no python3.11, and python3 is $(describe_python "$(pyver python3)"); MTPC needs $SUPPORTED_PYTHONS (set PYTHON=<interpreter>)" >&2
    return 1
  fi
}
