#!/usr/bin/env bash
# The prepared GPU check (see bench/gpu_check.py): the smoke run in fp32 and bf16 and a few SmolLM2
# steps on one GPU, from this source tree, written to one JSON file. PYTHON picks the interpreter
# that has the machine's CUDA torch (default python3); nothing is installed over it.
#   bench/gpu_check.sh [--wheels DIR] [--out DIR] [--dry-run]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
exec "$py" "$here/gpu_check.py" --python "$py" "$@"
