#!/usr/bin/env bash
# The prepared GPU check (see bench/gpu_check.py): a deadline-bound set of rollout=hf runs on one
# GPU from this source tree, written to one JSON file. PYTHON picks the interpreter that has the
# machine's CUDA torch (default python3); nothing is installed over its packages: carried wheels
# (bench/gpu_check_wheels.sh) go into OUT/site on PYTHONPATH.
#   bench/gpu_check.sh [--wheels DIR] [--out DIR] [--deadline S] [--dry-run]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python3}" "$here/gpu_check.py" "$@"
