"""The run folder: every artifact named once, a fresh start that moves exactly distflow's artifacts
aside, and a folder distflow did not write refused (a real earlier LoRA + W&B run moved aside:
distributed/test_trainer_loop.py). Its lock, against a real second process; folders that cannot be
created or written, on a real read-only mount and a real full one."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from distflow.config import ConfigError
from distflow.run.rundir import MARKER, RunDir
from mount_helpers import fill, private_tmpfs

ARTIFACTS = ["config.json", "metrics.jsonl", "summary.json", "training.png", "checkpoints/step_000002/COMPLETE",
             "hf_model/model.safetensors", "adapter/adapter_config.json", "wandb/offline-run-1/run.wandb",
             "wandb_run_id", "tb/events.out.tfevents.1", "logs/rank_0.log", "logs/rank_1.log"]
FOREIGN = ["notes.txt", "data/train.jsonl", "logs/4242-node01.log", "launch.txt", ".hydra/config.yaml",
           "previous/20250101-000000/metrics.jsonl"]


def _write(root, names, text="x"):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": {}, "rollout": {}, "algorithm": {}}) if name == "config.json" else text)


def test_a_fresh_start_moves_exactly_the_earlier_runs_artifacts(tmp_path):
    run = RunDir(tmp_path / "out")
    run.claim()
    _write(run.root, ARTIFACTS)
    _write(run.root, FOREIGN, "keep me")
    moved = run.set_aside()
    assert moved.parent == run.previous
    left = sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*") if p.is_file())
    assert [p for p in left if not p.startswith("previous/")] == sorted(f for f in FOREIGN if not f.startswith("prev"))
    assert all((run.root / f).read_text() == "keep me" for f in FOREIGN)
    got = sorted(p.relative_to(moved).as_posix() for p in moved.rglob("*") if p.is_file())
    assert got == sorted([*ARTIFACTS, MARKER])
    assert run.set_aside() is None  # nothing of distflow's is left
    run.claim()
    assert run.marker.is_file() and run.written_by_distflow()


def test_a_folder_distflow_did_not_write_is_refused_and_left_alone(tmp_path):
    run = RunDir(tmp_path / "someone_else")
    _write(run.root, ["checkpoints/model.pt", "notes.txt"])
    (run.root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # an HF model's config
    before = sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*"))
    with pytest.raises(ConfigError, match=r"^run.output_dir .* holds files distflow did not write \(config.json, "
                                          r"checkpoints\); choose an empty or new folder$"):
        run.set_aside()
    assert sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*")) == before


def test_a_run_from_before_the_marker_is_recognised_by_its_config(tmp_path):
    run = RunDir(tmp_path / "old")
    _write(run.root, ["config.json", "metrics.jsonl"])
    assert not run.marker.exists() and run.written_by_distflow()
    assert sorted(p.name for p in run.set_aside().iterdir()) == ["config.json", "metrics.jsonl"]


def test_an_empty_or_foreign_only_folder_needs_no_set_aside(tmp_path):
    run = RunDir(tmp_path / "new")
    assert run.set_aside() is None and not run.root.exists()
    _write(run.root, ["notes.txt", "logs/job-node.log"])
    assert run.set_aside() is None  # nothing under distflow's names: nothing to refuse or move
    two_runs = RunDir(tmp_path / "twice")
    for _ in range(2):  # two set-asides within one second get distinct folders
        two_runs.claim()
        _write(two_runs.root, ["metrics.jsonl"])
        two_runs.set_aside()
    assert len(list(two_runs.previous.iterdir())) == 2


def test_a_folder_with_only_a_previous_of_its_own_is_refused_but_a_launchers_logs_are_not(tmp_path):
    mine = RunDir(tmp_path / "mine")
    _write(mine.root, ["previous/draft.txt", "previous/old/results.csv"], "keep me")
    with pytest.raises(ConfigError, match=r"holds files distflow did not write \(previous\)"):
        mine.set_aside()
    assert sorted(p.relative_to(mine.root).as_posix() for p in mine.root.rglob("*") if p.is_file()) == \
        ["previous/draft.txt", "previous/old/results.csv"]
    other_tool = RunDir(tmp_path / "other_tool")
    _write(other_tool.root, ["checkpoints/epoch_3.pt"])
    with pytest.raises(ConfigError, match=r"holds files distflow did not write \(checkpoints\)"):
        other_tool.set_aside()
    assert (other_tool.checkpoints / "epoch_3.pt").is_file()
    launcher = RunDir(tmp_path / "launcher")  # launch/*.sh write these before rank 0 starts
    _write(launcher.root, ["logs/4242-node01.log", "launch.txt"])
    assert launcher.set_aside() is None and (launcher.logs / "4242-node01.log").is_file()


# ----------------------------------------------------------------------------- the lock
HOLD = "import sys, time; from distflow.run.rundir import RunDir; print(RunDir(sys.argv[1]).lock(), flush=True); " \
       "time.sleep(120)"
TRY = ("import sys; from distflow.config import ConfigError; from distflow.run.rundir import RunDir\n"
       "try:\n    RunDir(sys.argv[1]).lock()\nexcept ConfigError as e:\n    sys.exit(str(e))")


def _holder(root) -> subprocess.Popen:
    """Another process that took the folder's lock and lives on."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "None"
    return proc


def _in_use(root, pid) -> str:
    return (rf"^run.output_dir {re.escape(str(root))} is in use by another run \(host {re.escape(socket.gethostname())}"
            rf", pid {pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it to end, or choose another "
            r"run.output_dir$")


def test_one_folder_one_live_run_and_a_killed_runs_lock_does_not_block(tmp_path):
    run = RunDir(tmp_path / "out")
    holder = _holder(run.root)
    try:
        with pytest.raises(ConfigError, match=_in_use(run.root, holder.pid)):
            RunDir(run.root).lock()
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel drops its lock
        holder.wait()
        holder.stdout.close()
    assert json.loads(run.lockfile.read_text())["pid"] == holder.pid  # its record is still there, stale
    assert run.lock() is None and json.loads(run.lockfile.read_text())["pid"] == os.getpid()
    try:
        # this process is the live run now: a launch from another process is refused, naming it
        other = subprocess.run([sys.executable, "-c", TRY, str(run.root)], capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and re.match(_in_use(run.root, os.getpid()), other.stderr.strip()), other.stderr
    finally:
        run.unlock()
    assert not run.lockfile.exists()  # a run that ends leaves no lock file behind
    again = subprocess.run([sys.executable, "-c", TRY, str(run.root)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr


def test_an_output_dir_that_cannot_be_created_or_written_stops_with_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=rf"^run.output_dir {a_file}/run cannot be created: Not a directory$"):
        RunDir(a_file / "run").lock()
    too_long = tmp_path / ("n" * 256) / "run"
    with pytest.raises(ConfigError, match=rf"^run.output_dir {too_long} cannot be created: File name too long$"):
        RunDir(too_long).check()
    with private_tmpfs(tmp_path / "ro", readonly=True) as ro:
        with pytest.raises(ConfigError, match=rf"^run.output_dir {ro}/run cannot be created: Read-only file system$"):
            RunDir(ro / "run").lock()
        with pytest.raises(ConfigError, match=rf"^run.output_dir {ro} is not writable: Read-only file system$"):
            RunDir(ro).lock()
        assert list(ro.iterdir()) == []
    with private_tmpfs(tmp_path / "full", size="16k") as full:
        filler = fill(full)
        with pytest.raises(ConfigError, match=rf"^run.output_dir {full}/a/run is not writable: could not write "
                                              rf"{full}/a/run/.distflow-lock: No space left on device \(0 B free "
                                              r"there\)$"):
            RunDir(full / "a" / "run").lock()
        assert sorted(os.listdir(full)) == ["filler"]  # what the refused launch created is gone again, parents too
        filler.unlink()
        assert RunDir(full / "a" / "run").check() is None  # a pre-flight: passes, and leaves nothing
        assert sorted(os.listdir(full)) == []
        assert RunDir(full / "run").lock() is None
        RunDir(full / "run").unlock()


# ----------------------------------------------------------------------------- between torchrun attempts
AGENT = """
import os, subprocess, sys
rank0 = ("import sys; from distflow.config import ConfigError; from distflow.run.rundir import RunDir\\n"
         "try:\\n    RunDir(sys.argv[1]).lock()\\nexcept ConfigError as e:\\n    sys.exit(str(e))")
for restart in sys.stdin:  # one attempt per line, with this TORCHELASTIC_RESTART_COUNT; it locks and exits
    env = dict(os.environ, TORCHELASTIC_RUN_ID=sys.argv[2], TORCHELASTIC_RESTART_COUNT=restart.strip())
    attempt = subprocess.run([sys.executable, "-c", rank0, sys.argv[1]], env=env, capture_output=True, text=True)
    print(attempt.returncode, attempt.stderr.strip(), flush=True)
"""


def _agent(root, run_id: str) -> subprocess.Popen:
    """A stand-in for torchrun's agent: it starts rank 0's attempts, which lock the folder and exit
    without unlocking (as a failed rank does), and lives on between them."""
    proc = subprocess.Popen([sys.executable, "-c", AGENT, str(root), run_id], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert _attempt(proc, 0) == "0"
    return proc


def _attempt(agent: subprocess.Popen, restart: int) -> str:
    agent.stdin.write(f"{restart}\n")
    agent.stdin.flush()
    return agent.stdout.readline().strip()


def _end(agent: subprocess.Popen) -> None:
    agent.stdin.close()
    agent.wait(timeout=60)  # gone and reaped: no zombie that still looks alive
    agent.stdout.close()


def _launch(monkeypatch, root, run_id: str | None = None, restart: int = 0) -> RunDir:
    """A launch of rank 0 into `root` (under torchrun: with its run id and restart count)."""
    for var, value in (("TORCHELASTIC_RUN_ID", run_id), ("TORCHELASTIC_RESTART_COUNT", str(restart))):
        if run_id is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    run = RunDir(root)
    assert run.lock() is None
    return run


def test_between_two_attempts_of_a_torchrun_run_its_folder_is_still_its_own(tmp_path, monkeypatch):
    out = tmp_path / "out"
    agent = _agent(out, "run-a")
    try:
        record = json.loads((out / ".distflow-lock").read_text())
        assert (record["run_id"], record["agent_pid"]) == ("run-a", agent.pid)
        refused = (rf"^run.output_dir {re.escape(str(out))} is in use by another run \(host "
                   rf"{re.escape(socket.gethostname())}, torchrun agent pid {agent.pid}, run id run-a: restarting its "
                   r"ranks\); wait for it to end, or choose another run.output_dir$")
        for run_id, restart in (("run-b", 0), (None, 0), ("run-a", 0)):  # another run; outside torchrun; a fresh launch
            with pytest.raises(ConfigError, match=refused):
                _launch(monkeypatch, out, run_id, restart)
        assert json.loads((out / ".distflow-lock").read_text()) == record  # a refusal leaves the record
        # the run's own next attempts take the folder over: from its agent, also uncounted (a node
        # joined), and, with the same run id and a restart count, from another agent
        assert _attempt(agent, 0) == "0" and json.loads((out / ".distflow-lock").read_text())["pid"] != record["pid"]
        mine = _launch(monkeypatch, out, "run-a", 1)
        record = json.loads((out / ".distflow-lock").read_text())
        assert (record["pid"], record["run_id"], record["agent_pid"]) == (os.getpid(), "run-a", os.getppid())
        mine.unlock()
    finally:
        _end(agent)
    _end(_agent(out, "run-c"))  # its agent is gone: nothing holds the folder any more
    _launch(monkeypatch, out, "run-b").unlock()


def test_a_reused_agent_pid_or_another_hosts_record_does_not_hold_the_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    with open(f"/proc/{os.getpid()}/stat") as f:  # field 22: when this process started, in ticks after boot
        started = int(f.read().rsplit(")", 1)[1].split()[19])
    # an agent that is alive on this host (this process), one whose pid now names a later process, another host's
    live = {"host": socket.gethostname(), "pid": 1, "started": "2025-01-01 00:00:00", "run_id": "run-a",
            "agent_pid": os.getpid(), "agent_start": started}
    for record, held in ((live, True), ({**live, "agent_start": live["agent_start"] - 1}, False),
                         ({**live, "host": "another-host"}, False)):
        (out / ".distflow-lock").write_text(json.dumps(record))
        if held:
            with pytest.raises(ConfigError, match=rf"\(host {re.escape(socket.gethostname())}, torchrun agent pid "
                                                  rf"{os.getpid()}, run id run-a: restarting its ranks\)"):
                _launch(monkeypatch, out, "run-b")
        else:
            _launch(monkeypatch, out, "run-b").unlock()
