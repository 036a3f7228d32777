"""What a failing launch looks like. Through launch/local.sh a config mistake is one line and exit
status 2 before torchrun starts. Under bare torchrun: a config or input mistake is one `distflow:
error:` line per rank that reaches it, named in torchrun's failure summary, with nothing loaded; a
rank killed mid-run is restarted by torchrun and resumes; a rank that raises fails the job with its
own error, and a second launch into its folder while it is live is refused; a rank that raises
where the ranks agree on failures (its report) stops every rank with its line; nodes launched with
different overrides are refused; Hydra's multirun is refused. The other config and data errors, and
every rank saying each, are checked in-process on 2 ranks (distributed/test_trainer_loop.py): these
few prove the behaviour through the real entry points."""

import json
import os
import subprocess
import sys
import time

import pytest

from dist_helpers import free_port
from launch_helpers import LOADING, ROOT, assert_clean_failure, fail_run, launch_env, pinned, read_metrics, torchrun, \
    torchrun_command

RECIPES = ROOT / "recipes"

BASE = ["experiment=smoke", "task.reward=rewards_for_tests:digit_fraction", "checkpoint.every=2"]


def test_an_unknown_logger_stops_the_ranks_before_any_weights_load(tmp_path):
    """Bare torchrun (no pre-flight): the ranks say it, and torchrun's failure summary names it."""
    proc = fail_run(["logging.loggers=[jsonl,bogus]"], tmp_path)
    assert_clean_failure(proc, "distflow: error: logging.loggers must be one of console, jsonl, wandb, tensorboard; "
                               "got 'bogus'")
    assert not (tmp_path / "logs").exists()  # refused before anything was written
    # the root cause has its rank's error file (a peer torchrun stopped before it said the line has none)
    assert "<N/A>" not in proc.stderr.split("Root Cause", 1)[-1], proc.stderr[-3000:]
    assert [text for text in proc.stderr.splitlines() if "distflow: error:" in text and not text.startswith(
        ("distflow: error:", "  traceback : distflow: error:"))] == []  # each line whole, none glued to another


@pytest.mark.parametrize("mistake, line", [
    ("validation.at_end=true", "validation needs a held-out split: set task.heldout_path"),
    ("experiment=smok", ("In 'grpo': Could not find 'experiment/smok' Available options in 'experiment': "
                         "agent_smoke demo demo_lora smoke tools_smoke tools_smollm2")),
])
def test_a_config_mistake_through_local_sh_is_one_line_and_exit_2(tmp_path, mistake, line):
    """launch/local.sh's pre-flight: one process composes and validates the config; a mistake is
    that one line, nothing else, exit status 2, and no rank was started (nothing written)."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "2", "experiment=smoke", f"run.output_dir={out}",
                           mistake], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"distflow: error: {line}\n")
    assert not out.exists()


@pytest.mark.slow
def test_killed_rank_is_restarted_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = torchrun([*BASE, "rollout=hf", f"run.output_dir={out}", "run.steps=4", "run.fault_inject=1:3"],
                    torchrun_args=["--max-restarts=1", "--monitor-interval=1"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resumed from step 2" in proc.stdout, proc.stdout[-3000:]
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [1, 2, 3, 4]  # each step exactly once, no gaps


def _lock_holder(out, proc, timeout: float) -> int:
    """The pid the live run's rank 0 wrote into the folder's lock file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return json.loads((out / ".distflow-lock").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise AssertionError(f"no lock holder in {out} (launch status {proc.poll()})")


@pytest.mark.slow
def test_raising_rank_fails_the_job_with_its_error_and_a_second_launch_meanwhile_is_refused(tmp_path):
    """While the run is live (its first scoring waits for a gate the test opens), a second launch
    into its folder (`python recipes/grpo.py`, one rank, checkpoint.resume=never: unguarded it would
    move the live run's files aside) stops with one line naming the live run's rank 0, before any
    weights load; the live run goes on to its injected fault."""
    out, logs, gate = tmp_path / "run", tmp_path / "first", tmp_path / "gate"
    overrides = [*BASE, "rollout=hf", f"run.output_dir={out}", "run.steps=3", "run.fault_inject=1:2:raise",
                 "run.collective_timeout_s=60"]
    gated = ["task.reward=gated_rewards:digit_fraction_after_gate", "task.reward_timeout_s=90"]
    with open(f"{logs}.out", "w") as stdout, open(f"{logs}.err", "w") as stderr:
        first = subprocess.Popen(torchrun_command([*overrides, *gated]), cwd=ROOT,
                                 env=launch_env({"DISTFLOW_TEST_GATE": str(gate)}), stdout=stdout, stderr=stderr)
        try:
            holder = _lock_holder(out, first, timeout=120)
            second = subprocess.run([sys.executable, str(RECIPES / "grpo.py"),
                                     *pinned([*overrides, "checkpoint.resume=never"])],
                                    cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
            assert first.poll() is None, "the first run ended before the second launch was refused"
            gate.touch()
            first.wait(timeout=240)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    text = second.stdout + second.stderr
    errors = [line for line in text.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert second.returncode == 2 and len(errors) == 1, text[-3000:]
    assert errors[0].startswith(f"distflow: error: run.output_dir {out} is in use by another run (host ") \
        and f", pid {holder}, started " in errors[0], errors[0]
    assert LOADING not in text
    assert not (out / "previous").exists()  # nothing of the live run was moved
    assert first.returncode != 0
    failed = "distflow: rank 1 failed: RuntimeError: injected fault on rank 1 at step 2"
    assert failed in (tmp_path / "first.err").read_text()
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_a_rank_that_raises_in_its_report_stops_every_rank_with_its_line(tmp_path):
    """A rank-local region the ranks agree on (distflow.distributed.agreement): rank 1 raises in step
    1's report, and every rank prints that rank's line and exits with EXIT_ABORTED, instead of rank 0
    waiting in its next collective (60 s here) for torchrun to stop it."""
    from distflow.errors import EXIT_ABORTED

    proc = torchrun([*BASE, "rollout=hf", f"run.output_dir={tmp_path}", "run.steps=1", "run.collective_timeout_s=60",
                     "run.fault_inject=1:1:raise_report"], timeout=300, torchrun_args=["--monitor-interval=1"])
    line = ("distflow: error: rank 1 raised RuntimeError: injected fault on rank 1 in the report of step 1; stopped "
            "writing the report of step 1")
    assert proc.returncode == EXIT_ABORTED, proc.stderr[-3000:]
    assert proc.stderr.splitlines().count(line) == 2, proc.stderr[-3000:]  # one line from each rank
    assert "distflow: rank " not in proc.stderr, proc.stderr[-3000:]  # no rank ended on its own, unagreed error
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_multirun_under_torchrun_is_refused_and_old_spellings_are_noted_once(tmp_path):
    proc = torchrun(["-m", "experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.steps=1"], timeout=120)
    assert proc.returncode != 0
    assert "multirun (-m) is not supported under torchrun" in proc.stderr
    # the old spellings are renamed first, and said once (by rank 0), not once per rank
    for note in ("trainer.output_dir is deprecated: use run.output_dir", "trainer.steps is deprecated: use run.steps"):
        assert proc.stderr.count(f"distflow: warning: {note}") == 1, proc.stderr[-2000:]


def test_nodes_launched_with_different_configs_are_refused(tmp_path):
    # two "nodes" (one torchrun launcher each); the second got a stray override
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}",
                          "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                          "--rdzv_id=cfgcheck", str(RECIPES / "grpo.py"), "experiment=smoke", "rollout=hf",
                          f"run.output_dir={tmp_path}", *extra],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, extra in enumerate([[], ["run.seed=7"]])
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    for _, err in outs:
        assert "the resolved config differs between ranks" in err, err[-3000:]
