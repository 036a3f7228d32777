"""Preemption end to end, through launch/local.sh and real torchrun: a signal to one rank or to
the torchrun agent saves one step on every rank and exits 75; relaunches resume on 2 -> 1 -> 2
ranks; a rank killed in the middle of a checkpoint write leaves the previous checkpoint in
charge; every step is logged once and every item of an epoch is seen once. (The decision itself, on gloo ranks: distributed/test_preemption.py.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from distflow.checkpoint.checkpointer import latest_checkpoint
from launch_helpers import ROOT, SUPPORT, read_metrics

ITEMS, STEPS = 12, 12
BASE = ["experiment=smoke", "rollout=hf", "task.reward=rewards_for_tests:digit_fraction", f"task.split='train[:{ITEMS}]'",
        f"run.steps={STEPS}", "logging.progress_bar=false"]


class Launch:
    """launch/local.sh NPROC overrides..., in the background."""

    def __init__(self, nproc: int, out: Path, *extra: str, stop_file: Path | None = None):
        env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
        if stop_file is not None:
            env["DISTFLOW_STOP_FILE"] = str(stop_file)
        self.out = out
        self.proc = subprocess.Popen(["bash", str(ROOT / "launch" / "local.sh"), str(nproc), *BASE,
                                      f"run.output_dir={out}", *extra], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            path = self.out / "metrics.jsonl"
            if path.is_file() and len(path.read_text().splitlines()) >= step:
                return
            assert self.proc.poll() is None, self.proc.stdout.read()[-3000:]
            time.sleep(0.05)
        pytest.fail(f"step {step} not reached in {timeout}s")

    def agent(self) -> int:
        """The torchrun agent: local.sh's child."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])

    def rank_pid(self, rank: int) -> int:
        for pid in Path(f"/proc/{self.agent()}/task/{self.agent()}/children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(pid)
        raise AssertionError(f"no rank {rank} under the agent")

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"launch did not end in {timeout}s:\n{out[-3000:]}")
        return self.proc.returncode, out


def _stop_line(out: Path, rank: int) -> str:
    return [line for line in (out / "logs" / f"rank_{rank}.log").read_text().splitlines() if "stopped after step" in line][-1]


def _items_by_step(out: Path) -> dict[int, set]:
    """(epoch, index) pairs each step drew, from every rank's log over every launch."""
    found: dict[int, set] = defaultdict(set)
    pattern = re.compile(r"step (\d+) items \(epoch, index\): (.*)$")
    for log in (out / "logs").glob("rank_*.log"):
        for line in log.read_text().splitlines():
            m = pattern.search(line)
            if m:
                found[int(m.group(1))] |= {tuple(p) for p in json.loads(m.group(2))}
    return found


@pytest.mark.slow
def test_signals_stop_all_ranks_at_one_step_and_relaunches_resume_on_other_world_sizes(tmp_path):
    out, stop_file = tmp_path / "run", tmp_path / "stop.json"

    # 1. two ranks, a save every step by the clock; SIGUSR1 (twice) to rank 1 only
    first = Launch(2, out, "checkpoint.every_s=0.001", stop_file=stop_file)
    first.wait_for_step(2)
    rank1 = first.rank_pid(1)
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGUSR1)
    time.sleep(0.1)
    os.kill(rank1, signal.SIGUSR1)  # a second signal changes nothing
    rc, log = first.finish()
    print(f"SIGUSR1 to rank 1 -> exit: {time.monotonic() - t0:.1f}s")
    assert rc == 75, log[-3000:]
    stopped = json.loads(stop_file.read_text())
    k1 = stopped["step"]
    assert stopped["signal"] == "a signal to another rank" and 2 <= k1 < STEPS  # rank 0's view
    assert f"stopped after step {k1}" in _stop_line(out, 0) and "a signal to another rank" in _stop_line(out, 0)
    assert f"SIGUSR1: stopped after step {k1}" in _stop_line(out, 1)
    assert latest_checkpoint(out / "checkpoints").name == f"step_{k1:06d}"
    assert len(list((out / "checkpoints").iterdir())) == 2  # the clock saved the step before too (keep_last=2)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, k1 + 1))

    # 2. one rank resumes the two ranks' checkpoint; SIGTERM to the torchrun agent
    second = Launch(1, out, stop_file=stop_file)
    second.wait_for_step(k1 + 1)
    t0 = time.monotonic()
    os.kill(second.agent(), signal.SIGTERM)
    rc, log = second.finish()
    print(f"SIGTERM to the agent -> exit: {time.monotonic() - t0:.1f}s")
    assert rc == 75, log[-3000:]
    assert f"resumed from step {k1} written by 2 rank(s), now 1" in log
    k2 = json.loads(stop_file.read_text())["step"]
    assert k1 < k2 < STEPS - 2 and f"SIGTERM: stopped after step {k2}" in _stop_line(out, 0)

    # 3. two ranks again; rank 0 dies in the middle of writing step k2 + 2's checkpoint
    rc, log = Launch(2, out, "checkpoint.every=1", f"run.fault_inject=0:{k2 + 2}:kill_saving").finish()
    assert rc != 0 and f"resumed from step {k2} written by 1 rank(s), now 2" in log
    assert (out / "checkpoints" / f"step_{k2 + 2:06d}.tmp").is_dir()  # torn, never renamed
    assert latest_checkpoint(out / "checkpoints").name == f"step_{k2 + 1:06d}"

    # 4. the relaunch continues from the last complete checkpoint to the end
    rc, log = Launch(2, out).finish()
    assert rc == 0, log[-3000:]
    assert f"resumed from step {k2 + 1} (" in log
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))  # each step once
    assert not list((out / "checkpoints").glob("*.tmp"))  # the next save cleared the torn one
    steps = _items_by_step(out)
    assert sorted(steps) == list(range(1, STEPS + 1))
    drawn = [pair for s in sorted(steps) for pair in steps[s]]
    assert len(drawn) == len(set(drawn))  # no item twice in an epoch (a re-run step draws the same ones)
    epochs = defaultdict(list)
    for epoch, index in drawn:
        epochs[epoch].append(index)
    assert len(epochs) >= 2 and all(sorted(epochs[e]) == list(range(ITEMS)) for e in sorted(epochs)[:-1])
    assert len(drawn) == 4 * (STEPS - (k2 - k1)) + 2 * (k2 - k1)  # 2 ranks x 2 prompts, or 1 x 2
    # (relaunching the finished run, or another run into its folder: distributed/test_trainer_loop.py)
