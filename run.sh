#!/usr/bin/env bash
# One entry point for a fresh machine: set-up (a virtual environment with torch and this package,
# its C++ extension built against the installed torch) and then the job asked for.
#   bash run.sh example   # the main job: examples/finetune.py
#   bash run.sh test      # the whole test suite (compiled ops and the pure-PyTorch reference)
#   bash run.sh bench     # the benchmarks, results written to benchmarks/RESULTS.md
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${TORCHSTRUCT_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    if "$PYTHON" -c "import torch" 2>/dev/null; then
      # keep the torch that is already installed (a CUDA machine has its own build)
      "$PYTHON" -m venv --system-site-packages "$VENV"
    else
      "$PYTHON" -m venv "$VENV"
    fi
  fi
  # torch==2.13.0 is the CPU build on these machines; never an unpinned torch (gigabytes of CUDA)
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  # an editable build needs setuptools >= 70.1 (or an older one with wheel)
  "$PY" - <<'PYEOF' 2>/dev/null || "$PY" -m pip install -q "setuptools>=70.1"
import importlib.util, setuptools
major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
assert (major, minor) >= (70, 1) or importlib.util.find_spec("wheel")
PYEOF
  # rebuild only when the build inputs changed
  stamp="$VENV/.torchstruct-build"
  digest=$(cat setup.py setup.cfg csrc/*.* csrc/*/*.* 2>/dev/null | cksum)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ] || ! "$PY" -c "import torchstruct" 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation -e ".[test]"
    echo "$digest" > "$stamp"
  fi
  "$PY" -c "import torchstruct as ts; print('torchstruct', ts.__version__, 'backend:', ts.backend())"
}

# packages a job needs beyond the install (the plot); installed once, never torch
need() {
  local missing=()
  for pkg in "$@"; do "$PY" -c "import $pkg" 2>/dev/null || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then "$PY" -m pip install -q "${missing[@]}"; fi
}

case "${1:-}" in
  example) setup; shift; need matplotlib numpy; exec "$PY" examples/finetune.py "$@" ;;
  test)    setup; shift; TORCHSTRUCT_REQUIRE_COMPILED=${TORCHSTRUCT_REQUIRE_COMPILED:-1} exec "$PY" -m pytest "$@" ;;
  bench)   setup; shift; need matplotlib numpy; exec "$PY" -m benchmarks "$@" ;;
  *) echo "usage: bash run.sh example|test|bench [args...]" >&2; exit 2 ;;
esac
