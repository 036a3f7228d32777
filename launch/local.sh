#!/usr/bin/env bash
# Single-node launch with sane thread settings:
#   launch/local.sh [NPROC] [hydra overrides...]     e.g.  launch/local.sh 2 experiment=smoke
# On CPU each rank gets an equal share of the cores (OMP_NUM_THREADS = cores / ranks).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
nproc=${1:-2}
shift || true
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
py=${PYTHON:-$here/.venv/bin/python}
exec "$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$here/recipes/grpo.py" "$@"
