#!/usr/bin/env bash
# Single-node launch with sane thread settings:
#   launch/local.sh [NPROC] [hydra overrides...]     e.g.  launch/local.sh 2 experiment=smoke
# On CPU each rank gets an equal share of the cores (OMP_NUM_THREADS = cores / ranks).
#
# Stopping and resuming: SIGTERM or SIGUSR1 to this script (`kill -USR1 <pid>`) is passed to
# torchrun and on to every rank; the ranks finish the step, save a checkpoint and exit, and this
# script exits 75 (EX_TEMPFAIL). Run the same command again with the same run.output_dir to
# resume from that checkpoint (checkpoint.resume=auto). SIGINT is passed on too, but the trainer
# does not save on it. A config mistake exits 2 before torchrun starts (the pre-flight below). Any
# other end exits with torchrun's status.
#
# Environment knobs: PYTHON, OMP_NUM_THREADS, GRACE_S (seconds torchrun waits for the ranks to
# save after a signal before it kills them; default 120), DISTFLOW_STOP_FILE (where rank 0 reports
# the stop; default a temporary file, removed at exit).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
nproc=${1:-2}
shift || true
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
py=${PYTHON:-$here/.venv/bin/python}

# Rank 0 writes {"step": K, "checkpoint": ..., "signal": ...} here once a signal-triggered
# checkpoint is complete; an empty file means the run ended some other way.
if [[ -z "${DISTFLOW_STOP_FILE:-}" ]]; then
    DISTFLOW_STOP_FILE=$(mktemp "${TMPDIR:-/tmp}/distflow-stop.XXXXXX")
    trap 'rm -f "$DISTFLOW_STOP_FILE"' EXIT
else
    : >"$DISTFLOW_STOP_FILE"  # a stale report from an earlier run must not count
fi
export DISTFLOW_STOP_FILE

# Pre-flight: one process composes and validates the config (no torch.distributed, no model) and
# checks that run.output_dir can be created, written and locked, so a config mistake or an unusable
# or busy folder is one `distflow: error:` line and exit status 2 before any rank starts.
"$py" "$here/recipes/grpo.py" --check-config --with-output-dir "$@" >/dev/null

# torchrun runs as a child, not exec'd, so this script can read the stop file after it ends.
# torchrun forwards SIGUSR1 to the ranks only when asked to handle it.
"$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout="${GRACE_S:-120}" \
    "$here/recipes/grpo.py" "$@" &
child=$!

forwarded=0
# (torchrun may have just ended: a failed kill is fine)
trap 'forwarded=1; kill -TERM "$child" 2>/dev/null || true' TERM
trap 'forwarded=1; kill -INT "$child" 2>/dev/null || true' INT
trap 'forwarded=1; kill -USR1 "$child" 2>/dev/null || true' USR1

# A trapped signal makes `wait` return early (status > 128) while torchrun still runs: wait
# again until it has really ended. Bash keeps the child's status, so a late wait still gets it.
while :; do
    forwarded=0
    status=0
    wait "$child" || status=$?
    (( forwarded )) || break
done

if [[ -s "$DISTFLOW_STOP_FILE" ]]; then
    echo "distflow: stopped after saving a checkpoint: $(cat "$DISTFLOW_STOP_FILE")" >&2
    exit 75
fi
exit "$status"
