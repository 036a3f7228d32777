"""Elastic torchrun: two one-rank "nodes" on one machine, one is SIGKILLed mid-run, the other
restarts its worker alone (world size 1), resumes from the last checkpoint and finishes.

Each node is a torchrun agent started with `--nnodes=1:2` and the same c10d endpoint. The agent
that binds the endpoint hosts the rendezvous store; killing that one ends both runs, so the test
kills the other one. Short keep-alive and last-call timeouts make the survivor's re-rendezvous
take seconds instead of the defaults' ~45 s (up to 15 s to declare the dead node gone, then 30 s
of last call). Much shorter keep-alives (a 2 s expiry) let a node busy loading its model be
declared dead by a late joiner, which then starts a run of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_helpers import free_port
from launch_helpers import ROOT, TESTS, read_metrics

STEPS = 6
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=120"


def _agent(port: int, out: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=elastic",
           f"--rdzv-conf={RDZV_CONF}", "--max-restarts=3", "--monitor-interval=1",
           str(ROOT / "recipes" / "grpo.py"), "experiment=smoke", "rollout=hf", f"trainer.output_dir={out}",
           f"trainer.steps={STEPS}", "trainer.checkpoint_every=1", "task.reward=rewards_for_tests:digit_fraction"]
    # its own session: the agent's process group, killed as a whole (each worker has its own too)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _listen_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    return inodes


def _listens_on(pid: int, port: int) -> bool:
    wanted = {f"socket:[{inode}]" for inode in _listen_inodes(port)}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            pass
    return False


def _descendants(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            children = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *_descendants(child)]
    return found


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a node: the agent's process group and its workers' (torchrun starts each worker in a
    session of its own, so killing the agent's group alone would leave the worker running)."""
    groups = {agent.pid}
    for pid in _descendants(agent.pid):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)


def _metric_steps(out: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(out)]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line half-written
        return []


@pytest.mark.slow
def test_run_survives_losing_the_node_that_does_not_host_the_store(tmp_path):
    out, port = tmp_path / "run", free_port()
    logs = {name: tmp_path / f"agent_{name}.log" for name in "ab"}
    agents = {name: _agent(port, out, logs[name]) for name in "ab"}
    try:
        deadline = time.monotonic() + 300
        while 2 not in _metric_steps(out):
            assert time.monotonic() < deadline, "no step 2 within 300 s"
            for name, agent in agents.items():
                assert agent.poll() is None, logs[name].read_text()[-5000:]
            time.sleep(0.5)
        # both nodes are in the run, one rank each
        assert (out / "logs" / "rank_1.log").is_file()
        host = [name for name, agent in agents.items() if _listens_on(agent.pid, port)]
        assert len(host) == 1, host
        victim, survivor = ("b", "a") if host == ["a"] else ("a", "b")
        _kill_node(agents[victim])
        killed_at = time.monotonic()
        rc = agents[survivor].wait(timeout=600)
        recovered_s = time.monotonic() - killed_at
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                _kill_node(agent)
    text = logs[survivor].read_text()
    assert rc == 0, f"survivor exited {rc} {recovered_s:.0f} s after the kill:\n{text[-8000:]}"
    assert "resumed from step" in text + (out / "logs" / "rank_0.log").read_text()
    assert _metric_steps(out) == list(range(1, STEPS + 1))
