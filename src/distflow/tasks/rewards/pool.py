"""Run a task's user code (reward functions, environment steps) in worker processes with a hard
per-call time limit.

    pool = TaskWorkers.from_task(cfg.task)           # or TaskWorkers(spec, workers, timeout_s)
    rewards, stats = pool.score([(prompt, completion, completion_ids, item), ...])
    results, stats = pool.steps([(item, transcript), ...])   # with an environment
    pool.close()                                     # or `with TaskWorkers(...) as pool:`

A Task (distflow.tasks.task) builds its pool with the environment it built itself. `RewardPool`
is the same class under its older name.

A spec is one reward spec ("numeric", "pkg.mod:fn") or a weighted combination {spec: weight};
the reward of a call is then sum(weight * component). Each (call, component) is one unit of
work: a unit that raises, returns anything but a finite real number, runs past `timeout_s`, or
kills its worker scores 0.0 and is counted in stats (errors / invalid / timeouts; a dead worker
counts as an error). The first failure of each kind per component is logged with its
traceback on logging.getLogger("distflow"); later ones are only counted.

Workers are fresh interpreters (subprocess; the spawn model without multiprocessing) given this
process's sys.path: nothing is forked from the threaded trainer (CUDA/NCCL/vLLM threads make
fork unsafe), and unlike multiprocessing's spawn the caller's __main__ is not re-imported. They
talk over socketpairs with multiprocessing Connections and resolve the specs themselves, so
user functions need not be picklable (the parent resolves them first, so a bad spec is a
ConfigError before any process starts); the specs and the environment's arguments reach them in
an unnamed temporary file (any size; a command line holds at most 128 KiB per argument). Their
environment is an allow-list of this process's (WORKER_ENV_NAMES, WORKER_ENV_PREFIXES), never a
name with TOKEN, KEY, SECRET, PASSWORD or CREDENTIAL in it: a reward that needs a credential
reads it from a file. Each reward's optional `prepare()` runs at worker
start-up, outside any deadline. Workers take batches of units and answer unit by unit, so each
unit's deadline starts when the previous one finished. A worker past its deadline, or dead, is
killed and replaced; the rest of its batch is re-queued and the other workers keep going. A
worker leaves by itself within ~1 s if this process dies.

`workers=0` runs rewards inline in this process, for debugging: failures are still caught and
counted, but there is no time limit and no protection against crashes or hangs.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait

from distflow.config import ConfigError
from distflow.tasks.envs import Step, build_env
from distflow.tasks.rewards.registry import RewardSpec, load_reward

log = logging.getLogger("distflow")
START_TIMEOUT_S = 120.0  # a worker that cannot import its rewards in this time is an environment problem
_STAT_KEY = {"error": "errors", "crash": "errors", "invalid": "invalid", "timeout": "timeouts"}
def _last_line(detail: object) -> str:
    """`: <the report's last line>` (a traceback's exception line), or nothing."""
    lines = [x.strip() for x in str(detail).strip().splitlines() if x.strip()]
    return f": {lines[-1][:300]}" if lines else ""


_WHAT = {"error": "raised", "crash": "killed its worker process", "invalid": "returned a non-number",
         "timeout": "timed out"}
# What reward and environment workers see of this process's environment: where things are (paths, caches,
# locale, time zone), how many threads to use, which rank they serve, offline switches.
WORKER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "LD_LIBRARY_PATH",
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMEXPR_MAX_THREADS",
    "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "NODE_RANK", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "HF_ENDPOINT", "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
})
WORKER_ENV_PREFIXES = ("LC_", "DISTFLOW_")
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


def worker_env(environ: dict[str, str]) -> dict[str, str]:
    """The allow-listed part of `environ`, less any name that marks a secret."""
    return {k: v for k, v in environ.items()
            if (k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES))
            and not any(m in k.upper() for m in SECRET_MARKERS)}


def _call(fn, args, step: bool = False) -> tuple[str, object]:
    """("ok", value) | ("error", traceback) | ("invalid", repr of what came back). A reward's value
    is a finite real number; an environment's (step=True) a Step with a finite reward."""
    try:
        value = fn(*args)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: B036 - a reward calling sys.exit() is a reward error too
        return "error", traceback.format_exc()
    if not step and isinstance(value, numbers.Real) and math.isfinite(value):
        return "ok", float(value)
    if step and isinstance(value, Step) and isinstance(value.reward, numbers.Real) and math.isfinite(value.reward):
        return "ok", value
    return "invalid", repr(value)[:200]


def _worker_main(fd: int, parent: int, spec_fd: int) -> None:
    """A worker's life: read the specs (and the environment) from spec_fd, resolve them, say "ready",
    then answer batches unit by unit. Unit component len(specs) is the environment's step. `parent`
    is the trainer's pid, taken before this interpreter started: a trainer that died during our
    start-up has already handed us to another parent, and must still count as gone."""

    def parent_gone() -> bool:
        return os.getppid() != parent

    def orphan_watch() -> None:  # a trainer killed with SIGKILL cannot close us: leave with it
        while not parent_gone():
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphan_watch, daemon=True).start()
    conn = Connection(fd)
    try:
        specs, env = json.loads(_read_all(spec_fd))
        os.close(spec_fd)
        fns = [load_reward(s) for s in specs]
        if env is not None:
            fns.append(build_env(*env).step)
        for fn in fns:
            if callable(getattr(fn, "prepare", None)):
                fn.prepare()
        conn.send("ready")
        while (batch := conn.recv()) is not None:
            for uid, comp, args in batch:
                conn.send((uid, *_call(fns[comp], args, step=comp == len(specs))))
    except (EOFError, OSError):  # the trainer closed us, or died: nothing to report to
        return
    except BaseException:
        if parent_gone():  # torn down during start-up: nobody reads a traceback now
            os._exit(0)
        raise  # a start-up failure the trainer reports ("died at start-up; see its stderr")


def _read_all(fd: int) -> bytes:
    """A file's whole content by pread: the workers share the open file (and its offset), so none moves it."""
    chunks = []
    while chunk := os.pread(fd, 1 << 20, sum(map(len, chunks))):
        chunks.append(chunk)
    return b"".join(chunks)


# The worker's command line: its socket's fd, the parent pid, the fd of a file holding [specs, env] as JSON,
# then this process's sys.path entries.
_BOOT = ("import sys; sys.path[:] = sys.argv[4:]; from distflow.tasks.rewards.pool import _worker_main; "
         "_worker_main(*map(int, sys.argv[1:4]))")


class _Worker:
    def __init__(self, spec_file):
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()), str(spec_file.fileno()),
                 *sys.path], pass_fds=[theirs.fileno(), spec_file.fileno()], env=worker_env(dict(os.environ)),
                start_new_session=True)  # start_new_session: Ctrl-C is the trainer's
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.started, self.ready, self.deadline = time.monotonic(), False, math.inf
        self.inflight: deque[int] = deque()  # uids sent and not yet answered, in order

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class TaskWorkers:
    """`spec`: a reward spec, a {spec: weight} combination, or a RewardSpec already resolved.
    `env`, `env_args`: the environment the workers build their own copy of; `env_instance`: this
    process's copy (its step serves workers=0), handed over by a Task that built it; without it the
    pool builds one, for a pool used on its own."""

    def __init__(self, spec: str | dict[str, float] | RewardSpec, workers: int, timeout_s: float, env: str = "",
                 env_args: dict | None = None, *, env_instance=None):
        # Every spec resolves here first (if not already): a typo fails at start-up as a ConfigError, not in a worker.
        rewards = spec if isinstance(spec, RewardSpec) else RewardSpec.parse(spec)
        self.components = list(rewards.components)
        self._fns = list(rewards.fns)
        # An environment's steps run here too (distflow.tasks.envs), under the same limit; building it
        # before any process starts makes a bad task.env a ConfigError first.
        if env_instance is not None and not env:
            raise ValueError("env_instance needs its spec `env`: the workers build their own copy from it")
        self._env = [env, dict(env_args or {})] if env else None
        self.env = env_instance if env_instance is not None else build_env(*self._env) if self._env else None
        if workers < 0 or timeout_s <= 0:
            raise ConfigError(f"need task.reward_workers >= 0 and task.reward_timeout_s > 0, got {workers}, {timeout_s}")
        if self.env is not None:
            self._fns.append(self.env.step)
            if callable(getattr(self.env, "check_step_timeout", None)):  # e.g. ToolEnv: its calls fit in a step
                self.env.check_step_timeout(float(timeout_s))
        self.timeout_s = float(timeout_s)
        self._specs = [s for s, _ in self.components]
        self._spec_file = tempfile.TemporaryFile()  # unnamed: gone with the pool; each worker reads it whole
        self._spec_file.write(json.dumps([self._specs, self._env]).encode())
        self._spec_file.flush()
        self._logged: set[tuple[str, str]] = set()
        self._workers = [self._start() for _ in range(workers)]  # start-up overlaps the caller's

    def _start(self) -> _Worker:
        return _Worker(self._spec_file)

    @classmethod
    def from_task(cls, task, rewards: RewardSpec | None = None, env_instance=None) -> "TaskWorkers":
        """From a TaskConfig: `rewards` (if non-empty) else `reward`, `reward_workers`,
        `reward_timeout_s`, and the environment (`env`, `env_args`) when there is one. A Task passes
        the reward it resolved and the environment it built."""
        rewards = rewards if rewards is not None else RewardSpec.from_task(task)
        return cls(rewards, task.reward_workers, task.reward_timeout_s, task.env, dict(task.env_args),
                   env_instance=env_instance)

    def wait_ready(self) -> "TaskWorkers":
        """Block until every worker has started. Optional: score() uses whichever are ready."""
        while not all(w.ready for w in self._workers):
            wait([w.conn for w in self._workers], timeout=1.0)
            self._workers = [self._check(w, [], deque(), {"restarts": 0}) for w in self._workers]
        return self

    def score(self, calls: list[tuple]) -> tuple[list[float], dict[str, int]]:
        """calls: (prompt, completion, completion_ids, item) tuples. Returns one reward per call
        and {"errors", "timeouts", "invalid", "restarts"} counts for this batch."""
        units = [(i, c) for i in range(len(calls)) for c in range(len(self.components))]
        results, stats = self._run(units, calls)
        rewards = [0.0] * len(calls)
        for (i, c), (kind, value) in zip(units, results):
            spec, weight = self.components[c]
            if kind == "ok":
                rewards[i] += weight * value
                continue
            self._failed(stats, kind, spec, f"reward {spec!r} {_WHAT[kind]} on completion {str(calls[i][1])[:200]!r}"
                         f"{_last_line(value)}; scored 0.0 (logged once, later ones only counted)", value)
        return rewards, stats

    def steps(self, calls: list[tuple[dict, list[dict]]]) -> tuple[list[tuple[str, object]], dict[str, int]]:
        """The environment's step for each (item, transcript) call: ("ok", Step), or the failure
        ("error" | "crash" | "invalid" | "timeout", detail); the first failure of each kind is
        logged. Also returns the counts, as score() does."""
        results, stats = self._run([(i, len(self.components)) for i in range(len(calls))], calls)
        for call, (kind, value) in zip(calls, results):
            if kind != "ok":
                self._failed(stats, kind, "env", f"environment {self._env[0]!r} {_WHAT[kind]} on a turn "
                             f"{str(call[1][-1].get('content'))[:200]!r}{_last_line(value)}; the episode ends there "
                             "(logged once, later ones only counted)", value)
        return results, stats

    def _run(self, units, calls) -> tuple[list, dict[str, int]]:
        """Each (call index, component) unit's (kind, value), in the workers (inline with none), and
        this batch's counts. Component len(self.components) is the environment's step."""
        stats = {"errors": 0, "timeouts": 0, "invalid": 0, "restarts": 0}
        if self._workers:
            return self._run_in_workers(units, calls, stats), stats
        env = len(self.components)
        return [_call(self._fns[c], calls[i], step=c == env) for i, c in units], stats

    def _failed(self, stats: dict, kind: str, key: str, line: str, detail: object) -> None:
        """Count a failed unit; log the first failure of each kind per key (a reward spec, or the env):
        one line on the console, the worker's whole report (a traceback) in the rank's log."""
        stats[_STAT_KEY[kind]] += 1
        if (kind, key) not in self._logged:
            self._logged.add((kind, key))
            log.warning(line)
            log.debug(f"{line}; what the worker reported:\n{detail}")

    def _run_in_workers(self, units, calls, stats) -> list:
        results: list = [None] * len(units)
        todo = deque(range(len(units)))
        while todo or any(w.inflight for w in self._workers):
            now = time.monotonic()
            for w in self._workers:  # one batch per idle worker; small batches keep the load even
                if w.ready and not w.inflight and todo:
                    size = max(1, min(64, len(todo) // (4 * len(self._workers))))
                    batch = [todo.popleft() for _ in range(min(size, len(todo)))]
                    try:
                        w.conn.send([(u, units[u][1], calls[units[u][0]]) for u in batch])
                        w.inflight.extend(batch)
                        w.deadline = now + self.timeout_s
                    except OSError:  # died while idle: nothing was lost, the check below replaces it
                        todo.extendleft(reversed(batch))
            deadlines = [w.deadline for w in self._workers if w.inflight]
            wait([w.conn for w in self._workers],  # a dead worker's end reads as EOF, so this wakes too
                 timeout=max(0.0, min(deadlines) - now) if deadlines else 1.0)
            for k, w in enumerate(self._workers):
                self._workers[k] = self._check(w, results, todo, stats)
        return results

    def _check(self, w: _Worker, results: list, todo: deque, stats: dict) -> _Worker:
        """Collect w's answers; kill and replace it if it died or is past its deadline."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg == "ready":
                    w.ready = True
                    continue
                uid, kind, value = msg
                w.inflight.popleft()
                results[uid] = (kind, value)
                w.deadline = time.monotonic() + self.timeout_s
        except (EOFError, OSError):
            pass  # it died; handled below
        alive, now = w.proc.poll() is None, time.monotonic()
        if alive and not w.ready and now - w.started > START_TIMEOUT_S:
            raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S:.0f}s")
        if alive and not (w.inflight and now > w.deadline):
            return w
        if not w.ready and not alive:
            raise RuntimeError(f"a reward worker died at start-up (exit code {w.proc.returncode}); see its stderr")
        w.kill()
        if w.inflight:  # the unit it was on is to blame; the rest of its batch is re-queued
            uid = w.inflight.popleft()
            results[uid] = ("timeout", f"no result within {self.timeout_s}s; worker killed") if alive else \
                ("crash", f"the worker process died (exit code {w.proc.returncode}) during this call")
            todo.extendleft(reversed(w.inflight))
        stats["restarts"] += 1
        return self._start()

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            try:
                w.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass  # busy in a reward: killed below
            w.kill()
        self._workers = []
        self._spec_file.close()

    def __enter__(self) -> "TaskWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


RewardPool = TaskWorkers  # the older name, which callers and tests still use
