"""RewardPool with real worker processes: failures score 0 and are counted, hangs cost about one
timeout, dead workers are replaced, bad specs fail before any process starts.

Test rewards live in tests/rewards_for_tests.py; workers find it because they get this
process's sys.path (conftest puts tests/ on it)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from launch_helpers import SUPPORT, children

from distflow.config import ConfigError, TaskConfig
from distflow.tasks.rewards.pool import RewardPool

MIS = "rewards_for_tests:misbehave"  # float(len(completion)) for mode "ok", else misbehaves


def calls(*modes: str, completion: str = "abcd") -> list[tuple]:
    return [("prompt", completion, [1, 2, 3], {"answer": "4", "mode": m}) for m in modes]


def records(caplog, spec: str, what: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "distflow" and spec in r.getMessage() and what in r.getMessage()]


@pytest.fixture
def pool():
    with RewardPool(MIS, workers=2, timeout_s=1.0) as p:
        yield p.wait_ready()  # so timings below measure scoring only


def test_matches_inline_and_spreads_over_workers():
    batch = [("p", f"The answer is {n}.", [0] * n, {"answer": str(n % 7)}) for n in range(40)]
    with RewardPool("numeric", 0, 1.0) as inline, RewardPool("numeric", 2, 5.0) as pooled:
        expected, _ = inline.score(batch)
        got, stats = pooled.score(batch)
    assert got == expected and sum(expected) == 7  # n % 7 == n for n < 7 only
    assert stats == {"errors": 0, "timeouts": 0, "invalid": 0, "restarts": 0}
    with RewardPool("rewards_for_tests:pid", 2, 5.0) as p:
        pids, _ = p.wait_ready().score(calls(*["ok"] * 64))
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_raise_scores_zero_counts_and_logs_once(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="distflow"):
        rewards, stats = pool.score(calls("ok", "raise", "raise", "ok", "raise"))
        pool.score(calls("raise"))
    assert rewards == [4.0, 0.0, 0.0, 4.0, 0.0]
    assert stats == {"errors": 3, "timeouts": 0, "invalid": 0, "restarts": 0}
    logged = records(caplog, MIS, "raised")
    assert len(logged) == 1  # once per pool and reward, not per call or batch
    assert "ValueError: deliberate failure in misbehave" in logged[0].getMessage()  # the worker's traceback


def test_invalid_returns(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="distflow"):
        rewards, stats = pool.score(calls("nan", "inf", "none", "str", "list", "true", "ok"))
    assert rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 4.0]  # a bool is a number
    assert stats == {"errors": 0, "timeouts": 0, "invalid": 5, "restarts": 0}
    assert len(records(caplog, MIS, "non-number")) == 1


def test_hang_is_bounded_and_others_proceed(pool, caplog):
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distflow"):
        rewards, stats = pool.score(calls("hang", "ok", "hang", "ok", "ok", "ok"))
    elapsed = time.monotonic() - t0
    # Each hang (it never returns) was cut by the timeout: scored 0, counted, its worker replaced,
    # and the other calls scored in full.
    assert rewards == [0.0, 4.0, 0.0, 4.0, 4.0, 4.0]
    assert stats["timeouts"] == 2 and stats["restarts"] == 2 and stats["errors"] == 0
    # The hang was given its whole timeout, and the batch ended anyway: the two hangs take ~1
    # timeout in parallel plus a worker restart. The upper bound is generous (a loaded machine
    # restarts workers slowly); a call that is not cut never returns at all.
    assert pool.timeout_s <= elapsed < 10 * pool.timeout_s, elapsed
    assert len(records(caplog, MIS, "timed out")) == 1
    assert pool.score(calls("ok", "ok"))[0] == [4.0, 4.0]  # replaced workers serve


def test_timeout_is_per_call_not_per_batch():
    # 96 calls of 0.1 s on 2 workers: the first batches hold 12 calls (at least 1.2 s each),
    # longer than the 1 s limit, which must still only apply to each call (10x the call's time,
    # so a loaded machine does not turn a 0.1 s sleep into a timeout).
    batch = [("p", "c", [], {"sleep": 0.1})] * 96
    with RewardPool("rewards_for_tests:slow_ok", 2, 1.0) as p:
        p.wait_ready()
        t0 = time.monotonic()
        rewards, stats = p.score(batch)
        elapsed = time.monotonic() - t0
    assert rewards == [1.0] * 96 and stats == {"errors": 0, "timeouts": 0, "invalid": 0, "restarts": 0}
    # the premise: the calls really slept (96 * 0.1 s over 2 workers), several timeouts in all
    assert elapsed >= 96 * 0.1 / 2, elapsed


def test_crashed_workers_are_replaced(caplog):
    with RewardPool(MIS, 2, 5.0) as p, caplog.at_level(logging.WARNING, logger="distflow"):
        rewards, stats = p.score(calls("ok", "exit", "ok", "segv", "ok", "exit", "ok", "ok"))
        assert rewards == [4.0, 0.0, 4.0, 0.0, 4.0, 0.0, 4.0, 4.0]
        assert stats == {"errors": 3, "timeouts": 0, "invalid": 0, "restarts": 3}
        assert p.score(calls("ok", "ok", "ok"))[0] == [4.0] * 3
        assert len(p._workers) == 2 and all(w.proc.poll() is None for w in p._workers)
    logged = records(caplog, MIS, "killed its worker")
    assert len(logged) == 1 and "exit code 1" in logged[0].getMessage()


@pytest.mark.parametrize("spec,match", [
    ("no_such_module_xyz:fn", "cannot be imported"),
    ("rewards_for_tests:no_such_function", "cannot be imported"),
    ("not_a_builtin", "neither a built-in"),
    ({"numeric": 1.0, "no_such_module_xyz:fn": 0.5}, "cannot be imported"),
    ({}, "empty"),
    ({"numeric": float("nan")}, "finite weight"),
])
def test_bad_spec_fails_before_spawning(spec, match):
    before = children()
    with pytest.raises(ConfigError, match=match):
        RewardPool(spec, workers=2, timeout_s=1.0)
    assert children() == before


def test_weighted_combination():
    spec = {MIS: 2.0, "format": 0.5, "length_penalty": 1.0}
    batch = calls("ok", "raise", "nan", completion="The answer is 4")  # len 15, 3 token ids
    for workers in (0, 2):
        with RewardPool(spec, workers, 5.0) as p:
            rewards, stats = p.score(batch)
        assert rewards == pytest.approx([2 * 15 + 0.5 - 0.003, 0.5 - 0.003, 0.5 - 0.003])
        assert stats["errors"] == 1 and stats["invalid"] == 1  # only the failing component is lost


def test_builtin_math_in_workers():
    batch = [("p", "so \\boxed{\\frac{1}{2}}", [], {"answer": "0.5"}), ("p", "\\boxed{3}", [], {"answer": "0.5"})]
    with RewardPool("math", 1, 10.0) as p:  # `prepare` imports sympy before the first call
        assert p.score(batch) == ([1.0, 0.0], {"errors": 0, "timeouts": 0, "invalid": 0, "restarts": 0})


def test_unpicklable_user_reward_runs_in_workers():
    with RewardPool("rewards_for_tests:unpicklable", 1, 5.0) as p:
        assert p.score(calls("ok"))[0] == [2.0]


def test_inline_mode_counts_failures_without_processes():
    before = children()
    with RewardPool(MIS, 0, 1.0) as p:
        assert children() == before
        rewards, stats = p.score(calls("ok", "raise", "none"))
    assert rewards == [4.0, 0.0, 0.0] and stats["errors"] == 1 and stats["invalid"] == 1


def test_from_task_and_close():
    task = TaskConfig(reward="numeric", rewards={"numeric": 1.0, "format": 0.25}, reward_workers=1, reward_timeout_s=3.0)
    p = RewardPool.from_task(task)
    assert p.components == [("numeric", 1.0), ("format", 0.25)] and p.timeout_s == 3.0
    assert p.score([("p", "The answer is 4", [], {"answer": "4"})])[0] == [1.25]
    procs = [w.proc for w in p._workers]
    p.close()
    assert all(proc.poll() is not None for proc in procs)
    assert RewardPool.from_task(TaskConfig(reward="gsm8k", reward_workers=0)).components == [("gsm8k", 1.0)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_leave_with_a_killed_parent_and_unguarded_main(tmp_path):
    """A script with no `if __name__ == "__main__"` guard (multiprocessing's spawn would re-run it
    in every worker) makes a pool, starts a hanging call and is SIGKILLed: its workers, in the
    middle of a reward, must exit by themselves."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "trainer_like.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(SUPPORT)!r})\n"
        "from distflow.tasks.rewards.pool import RewardPool\n"
        f"pool = RewardPool({MIS!r}, 2, 600.0).wait_ready()\n"
        "print(*[w.proc.pid for w in pool._workers], flush=True)\n"
        "pool.score([('p', 'c', [], {'mode': 'hang'})] * 2)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(0.5)  # both workers are now inside the hanging reward
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("end", ["exit", "close"])
def test_a_trainer_that_stops_during_pool_start_up_leaves_no_worker_traceback(end):
    """A trainer that stops while its workers still start (a config or data error found after the
    pool was made): by exiting at once, its workers then finding nobody to report to, or by
    closing the pool. Either way the workers leave in silence: the trainer's own error is the
    one thing on the console. (Each worker's stderr is the trainer's, so the pipe below reads to
    its end only once every worker has gone.)"""
    import subprocess
    import sys

    stop = "os._exit(3)" if end == "exit" else "pool.close(); sys.exit(3)"
    code = (f"import os, sys; sys.path.insert(0, {str(SUPPORT)!r})\n"
            "from distflow.tasks.rewards.pool import RewardPool\n"
            f"pool = RewardPool({MIS!r}, 2, 5.0)\n{stop}\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stderr == "" and proc.stdout == "", proc.stderr


def test_workers_get_an_allow_listed_environment_and_env_args_of_any_size(monkeypatch):
    """Secrets in the trainer's environment stay there, even under an allowed prefix; what rewards need
    (paths, threads, rank, offline switches, locale) gets through. The environment's arguments travel in a
    file, not on the command line (at most 128 KiB per argument)."""
    import json

    for name, value in {"HF_TOKEN": "t0ken", "OPENAI_API_KEY": "k3y", "DISTFLOW_SECRET_X": "s3cret",
                        "AWS_SECRET_ACCESS_KEY": "s3cret2", "DB_PASSWORD": "pw", "GOOGLE_APPLICATION_CREDENTIALS":
                        "/creds.json", "SOME_UNLISTED_NAME": "x", "OMP_NUM_THREADS": "3", "RANK": "1",
                        "HF_HUB_OFFLINE": "1", "LC_ALL": "C.UTF-8", "DISTFLOW_CACHE": "/tmp/dc"}.items():
        monkeypatch.setenv(name, value)
    blob = "x" * 250_000 + "the end"
    with RewardPool("numeric", 1, 30.0, env="envs_for_tests:EnvironEnv", env_args={"blob": blob}) as p:
        [(kind, step)], _ = p.steps([({}, [{"role": "assistant", "content": "hi"}])])
        assert kind == "ok"
        seen = json.loads(step.messages[0]["content"])
        assert p._workers[0].proc.pid != os.getpid()
    env = seen["environ"]
    assert (seen["blob_chars"], seen["blob_tail"]) == (len(blob), blob[-16:])
    assert not {"HF_TOKEN", "OPENAI_API_KEY", "DISTFLOW_SECRET_X", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                "GOOGLE_APPLICATION_CREDENTIALS", "SOME_UNLISTED_NAME"} & set(env)
    assert not {"t0ken", "k3y", "s3cret", "s3cret2", "pw"} & set(env.values())
    assert {k: env.get(k) for k in ("OMP_NUM_THREADS", "RANK", "HF_HUB_OFFLINE", "LC_ALL", "DISTFLOW_CACHE")} == \
        {"OMP_NUM_THREADS": "3", "RANK": "1", "HF_HUB_OFFLINE": "1", "LC_ALL": "C.UTF-8", "DISTFLOW_CACHE": "/tmp/dc"}
    assert env["PATH"] == os.environ["PATH"]
