"""A fake SLURM for the launch templates: stub srun, scontrol and nvidia-smi on PATH, and the
environment an allocation sets. `srun` either records its arguments (fast checks of what the
template builds from the SLURM_* variables) or runs its command once per fake node, concurrently,
with SLURM_NODEID/PROCID set and output to the template's per-node --output file (%N expanded),
killing the rest when one fails under --kill-on-bad-exit=1 and waiting for all of them under
--kill-on-bad-exit=0. Like srun, it exits with the highest status of its tasks, a task killed by
signal N counting as 128+N."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch_helpers import ROOT

TEMPLATES = {"single": ROOT / "launch" / "slurm" / "single_node.sbatch",
             "multi": ROOT / "launch" / "slurm" / "multi_node.sbatch"}

SRUN_STUB = r'''#!{python}
import json, os, signal, subprocess, sys, time
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
if os.environ.get("FAKE_SRUN_RECORD"):
    with open(os.environ["FAKE_SRUN_RECORD"], "w") as f:
        json.dump({{"opts": opts, "command": args, "env": dict(os.environ)}}, f)
    sys.exit(0)
nodes = int(opts.get("--nodes", os.environ["SLURM_NNODES"]))
procs = []
def forward(sig, frame):  # srun passes the signals it gets on to its tasks
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
for i in range(nodes):
    name = "fakenode%d" % i
    out = opts["--output"]
    for pat, val in (("%N", name), ("%j", os.environ["SLURM_JOB_ID"]), ("%n", str(i)), ("%t", str(i))):
        out = out.replace(pat, val)
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURMD_NODENAME=name)
    procs.append(subprocess.Popen(args, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT))
while any(p.poll() is None for p in procs):
    if opts.get("--kill-on-bad-exit") == "1" and any(p.poll() not in (None, 0) for p in procs):
        for p in procs:
            if p.poll() is None:
                p.terminate()
    time.sleep(0.2)
sys.exit(max(p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs))
'''

SCONTROL_STUB = r'''#!/usr/bin/env bash
# scontrol requeue <id>: recorded in $FAKE_SCONTROL_LOG
if [[ "$1" == requeue ]]; then
    echo "requeue $2" >>"${FAKE_SCONTROL_LOG:-/dev/null}"
    exit 0
fi
# scontrol show hostnames <list>: one name per line
[[ "$1 $2" == "show hostnames" ]] || exit 1
printf '%s\n' ${FAKE_HOSTNAMES}
'''

# nvidia-smi -L: no GPU, so a test machine's real GPUs never leak into what the template decides
NVIDIA_SMI_STUB = "#!/usr/bin/env bash\nexit 0\n"


def stub_bin(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN_STUB.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL_STUB)
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI_STUB)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def slurm_env(tmp_path, **extra) -> dict:
    knobs = ("PYTHON", "NPROC_PER_NODE", "OMP_NUM_THREADS", "MAX_RESTARTS", "MIN_NODES", "RDZV_CONF", "GRACE_S",
             "REQUEUE")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SRUN_", "MASTER_", "DISTFLOW_")) and k not in knobs}
    env.update(PATH=f"{stub_bin(tmp_path)}{os.pathsep}{env['PATH']}", SLURM_SUBMIT_DIR=str(ROOT),
               DISTFLOW_OUTPUT_ROOT=str(tmp_path / "outputs"))
    env.update(extra)
    return env


def start(script: Path, args: list[str], env: dict) -> subprocess.Popen:
    # its own session, so a timeout can stop the stub srun and every torchrun under it
    return subprocess.Popen(["bash", str(script), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"run timed out after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_template(which: str, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return finish(start(TEMPLATES[which], args, env), timeout)


def recorded_launch(tmp_path, which, args, **env_extra) -> dict:
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), **env_extra)
    proc = run_template(which, args, env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(record.read_text())


def sbatch_lines(path: Path) -> list[str]:
    return [line.rstrip("\n") for line in path.read_text().splitlines() if line.startswith("#SBATCH")]


def code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def fake_python(path: Path, cuda: str = "13.0") -> Path:
    """A stand-in interpreter that answers the template's torch check with a CUDA build (and passes
    its config pre-flight, whose output the template discards)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/usr/bin/env bash\necho "2.13.0 {cuda}"\n')
    path.chmod(0o755)
    return path


def fake_repo(tmp_path) -> Path:
    """A submit directory with the GPU venv's python (a stand-in) and the recipe."""
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    (repo / "recipes" / "grpo.py").write_text("")
    (repo / "launch" / "slurm").mkdir(parents=True)
    (repo / "launch" / "slurm" / "multi_node.sbatch").symlink_to(TEMPLATES["multi"])
    fake_python(repo / ".venv-gpu" / "bin" / "python")
    return repo
