#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every CUDA path of the package in one bounded run, summarised in OUT.
#
#   bash scripts/gpu_check.sh OUT                         # on a CUDA machine, with gpu-carry/ (scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --device cpu --quick OUT    # the same steps, small, on the CPU (CI runs this)
#
# The interpreter is $PYTHON, else .venv/bin/python where it exists, else python3 (the CUDA image's, with torch).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
