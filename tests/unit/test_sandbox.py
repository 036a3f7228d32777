"""Hostile programs through the python tool's real sandbox (distflow.tasks.envs.sandbox): each attack runs, and the
test checks on the host that its effect did not happen. No skips: a machine where the sandbox cannot start
fails here (CI must run the isolated path). Only the cgroup v2 memory limit has a test per kind of machine, one
of them skipped: with the limit, and without it (where a start-up note says the bound is per process only)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from distflow.config import ConfigError
from distflow.tasks.envs import ToolEnv, build_env, build_tools
from distflow.tasks.envs.python_tool import PROCESS_LIMIT, PythonExecutor
from distflow.tasks.envs.cgroup import PREFIX
from distflow.tasks.envs.cgroup import find as find_cgroups
from distflow.tasks.envs.sandbox import SANDBOX_ID
from distflow.tasks.rewards.pool import RewardPool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def python() -> PythonExecutor:
    tool = PythonExecutor(timeout_s=2, max_output_chars=200)  # a ConfigError here: no sandbox on this machine
    assert tool.sandbox is not None and tool.sandbox.mechanism == "namespaces"
    return tool


def run(python: PythonExecutor, code: str):
    return python({"code": textwrap.dedent(code)})


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds marker (the sandboxed code is on its processes' command lines)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def gone(marker: str, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_sandbox_runs_as_an_unprivileged_uid_in_its_own_pid_namespace(python):
    result = run(python, """
        import os
        print(os.getpid(), os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
    """)
    uid = SANDBOX_ID if os.getuid() == 0 else os.getuid()
    assert result.output == f"2 {uid} ['1', '2']\n0000000000000000\n"


def test_writes_to_the_venv_project_and_run_folder_do_not_land(python, tmp_path):
    """A .pth in site-packages would run at every interpreter start; the project and run folders hold code and
    checkpoints. The sandbox sees none of them (the run folder is invisible; a folder of that name made inside
    lands in its private /tmp) and the system folders it sees are read-only."""
    name = f"distflow_attack_{uuid.uuid4().hex}"
    targets = [Path(sysconfig.get_paths()["purelib"]) / f"{name}.pth",
               Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / f"{name}.py",
               REPO / f"{name}.py", REPO / "src" / "distflow" / f"{name}.py", tmp_path / name]
    result = run(python, f"""
        import os
        for path in {[str(t) for t in targets]!r}:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write("import os; os.system('echo owned')\\n")
                print("wrote", path)
            except OSError as e:
                print(type(e).__name__, e.strerror)
    """)
    assert not result.error, result.output
    assert "Read-only file system" in result.output  # the base interpreter's own folder is there, read-only
    assert [t for t in targets if t.exists()] == []


def test_the_trainers_environment_and_the_users_home_are_invisible(python, tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("DISTFLOW_TEST_TOKEN", secret)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine example.com login me password {secret}\n")
    monkeypatch.setenv("HOME", str(home))
    result = run(python, f"""
        import glob, os
        for path in ["/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ", "{home}/.netrc",
                     os.path.expanduser("~/.netrc"), *glob.glob("/proc/*/environ")]:
            try:
                print(path, open(path, "rb").read())
            except OSError as e:
                print(path, type(e).__name__)
        print(sorted(os.environ))
    """)
    assert secret not in result.output
    assert f"/proc/{os.getpid()}/environ FileNotFoundError" in result.output  # no such process in its namespace
    assert f"{home}/.netrc FileNotFoundError" in result.output


def test_other_processes_cannot_be_signalled(python):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        result = run(python, f"""
            import os, signal
            for pid in ({sleeper.pid}, {os.getpid()}):
                try:
                    os.kill(pid, signal.SIGKILL)
                    print("killed", pid)
                except OSError as e:
                    print(type(e).__name__)
        """)
        time.sleep(0.1)
        assert sleeper.poll() is None, result.output
        assert result.output == "ProcessLookupError\nProcessLookupError\n"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_connection_reaches_a_local_listener(python):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        result = run(python, f"""
            import socket
            for host in ("127.0.0.1", "localhost", "::1"):
                try:
                    socket.create_connection((host, {port}), timeout=1)
                    print("connected", host)
                except OSError as e:
                    print(host, type(e).__name__, e.strerror)
        """)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "connected" not in result.output and "Network is unreachable" in result.output


def test_a_detached_child_does_not_outlive_the_call(python, tmp_path):
    """fork + setsid leaves the process group the tool kills; the PID namespace's end takes it anyway. The same
    program without a sandbox (allow_unisolated on a machine without one) and without a memory cgroup (whose
    end would take it too) leaves it running: the control."""
    marker = f"marker_{uuid.uuid4().hex}"
    code = f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(30)  # {marker}
            os._exit(0)
        time.sleep(0.3)
        print("parent done")
    """
    result = run(python, code)
    assert result.output == "parent done\n"
    assert gone(marker, within_s=1.0), processes_with(marker)

    class Unisolated(PythonExecutor):
        _mechanisms = ()
        _cgroup_root = str(tmp_path)  # no /proc/self/cgroup there: no cgroup

    run(Unisolated(timeout_s=2, allow_unisolated=True), code)
    survivors = processes_with(marker)
    try:
        assert survivors  # the control: without the sandbox the grandchild survives
    finally:
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)


def test_a_fork_bomb_is_bounded_and_leaves_nothing(python):
    marker = f"marker_{uuid.uuid4().hex}"
    result = run(python, f"""
        import os, time
        n = 0
        while True:  # {marker}
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
            except OSError as e:
                print("refused after", n, e.strerror, flush=True)
                break
    """)
    refused = result.output.split()
    assert refused[:2] == ["refused", "after"] and int(refused[2]) < PROCESS_LIMIT, result.output
    assert gone(marker)
    start = time.monotonic()
    result = run(python, f"""
        import os
        while True:  # {marker}
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert result.timed_out and time.monotonic() - start < python.timeout_s + 3
    assert gone(marker)
    assert run(python, "print('still usable')").output == "still usable\n"


def test_memory_and_output_floods_are_bounded(python):
    result = run(python, "x = bytearray(10 * 10**9)")
    assert result.error and "MemoryError" in result.output
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run(python, """
        import sys
        chunk = "x" * 2**20
        for _ in range(1024):
            sys.stdout.write(chunk)
    """)
    assert time.monotonic() - start < python.timeout_s + 3
    assert len(result.output) < 300 and "...[truncated " in result.output
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: the 1 GiB was not kept


def forks_that_allocate(marker: str, memory_mib: int) -> str:
    """A program whose 8 children each hold 0.6 x its per-process limit (under RLIMIT_AS alone, over it together)."""
    return f"""
        import os, time
        r, w = os.pipe()
        for _ in range(8):
            if os.fork() == 0:
                data = b"x" * int(0.6 * {memory_mib} * 2**20)  # every page written  # {marker}
                os.write(w, b".")
                time.sleep(60)
                os._exit(0)
        got = b""
        while len(got) < 8:
            got += os.read(r, 8)
        print("all 8 allocated", flush=True)
        time.sleep(60)
    """


@pytest.fixture(scope="module")
def small() -> PythonExecutor:
    return PythonExecutor(timeout_s=2, memory_mib=64, max_output_chars=300)


def test_processes_that_together_pass_the_memory_limit_end_with_the_call_without_a_cgroup(small):
    """Where no cgroup v2 limit is possible (this machine, CI), the total is bounded per process only (the start-up
    note says so): the 8 x 38 MiB stay allocated until the call's timeout, which ends every process."""
    if small.cgroups is not None:
        pytest.skip(f"a cgroup v2 memory limit works here ({small.cgroups.base}): see the test below")
    marker = f"marker_{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run(small, forks_that_allocate(marker, 64))
    assert result.timed_out and result.output.startswith("error: timed out after 2s\nall 8 allocated"), result.output
    assert time.monotonic() - start < small.timeout_s + 3
    assert gone(marker), processes_with(marker)
    assert run(small, "print('still usable')").output == "still usable\n"


def test_processes_that_together_pass_the_memory_limit_are_killed_by_the_cgroup(small):
    """With a cgroup v2 limit (memory_mib + 64 MiB of /tmp = 128 MiB for all processes together) the OOM killer
    ends the whole program long before 8 x 38 MiB are held: the tool's out-of-memory observation."""
    if small.cgroups is None:
        pytest.skip(f"no cgroup v2 memory limit here: {find_cgroups(small.total_memory_bytes, PROCESS_LIMIT)[1]}")
    marker = f"marker_{uuid.uuid4().hex}"
    result = run(small, forks_that_allocate(marker, 64))
    assert result.error and not result.timed_out, result.output
    assert result.output.startswith("error: out of memory (all of its processes together may use 128 MiB)")
    assert "all 8 allocated" not in result.output
    assert gone(marker), processes_with(marker)
    assert not [n for n in os.listdir(small.cgroups.base) if n.startswith(f"{PREFIX}{os.getpid()}-")]
    assert run(small, "print('still usable')").output == "still usable\n"


def test_the_sandbox_dies_with_the_process_that_started_it(tmp_path):
    marker = f"marker_{uuid.uuid4().hex}"
    script = tmp_path / "worker_like.py"
    script.write_text(
        "from distflow.tasks.envs.python_tool import PythonExecutor\n"
        "print('ready', flush=True)\n"
        f"PythonExecutor(timeout_s=60)({{'code': 'import time; time.sleep(60)  # {marker}'}})\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while not processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker)
    finally:
        proc.kill()
        proc.wait()
    assert gone(marker)


# --- no sandbox: a refusal, or the explicit opt-out -------------------------------------------------------------


def test_without_a_sandbox_the_tool_refuses_to_start(monkeypatch):
    monkeypatch.setattr(PythonExecutor, "_mechanisms", ())
    for build in (lambda: PythonExecutor(), lambda: build_tools(["python"]),
                  lambda: build_env("tools", {"tools": ["calculator", "python"]})):
        with pytest.raises(ConfigError, match="no sandbox.*allow_unisolated=true") as e:
            build()
        assert "\n" not in str(e.value)
    env = ToolEnv(tools=["python"], allow_unisolated=True)  # the opt-out: runs, with the worker's rights
    tool = env.tools["python"]
    assert tool.sandbox is None and "no sandbox" in tool.description
    assert tool({"code": f"import os; print(os.path.exists({str(REPO)!r}))"}).output == "True\n"


# --- a turn's calls and the reward pool's limit on a step ---------------------------------------------------------


def test_a_turns_python_calls_must_fit_in_the_step_timeout():
    args = {"tools": ["python"], "timeout_s": 1.0, "max_calls_per_turn": 3}
    with pytest.raises(ConfigError, match="max_calls_per_turn=3.*task.reward_timeout_s=2.5") as e:
        RewardPool("numeric", 1, 2.5, env="tools", env_args=args)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="max_calls_per_turn must be an integer >= 1"):
        ToolEnv(tools=["python"], max_calls_per_turn=0)


def test_calls_past_the_cap_are_answered_not_run_and_the_worker_survives():
    """Three endless programs in one turn would take 3 tool timeouts, past the step's limit: the worker would be
    killed. With the cap (1 by default) the first one times out, the others are refused, within the limit."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    args = {"tools": ["python", "calculator"], "timeout_s": 1.0}
    with RewardPool("numeric", 1, 2.5, env="tools", env_args=args) as pool:
        pid = pool.wait_ready()._workers[0].proc.pid
        start = time.monotonic()
        [(kind, step)], stats = pool.steps([({}, [{"role": "assistant", "content": call * 3}])])
        elapsed = time.monotonic() - start
        assert kind == "ok" and stats["restarts"] == 0 and stats["timeouts"] == 0
        assert (step.tool_calls, step.tool_timeouts, step.tool_errors) == (3, 1, 2)
        assert [m["content"].splitlines()[0] for m in step.messages] == \
            ["error: timed out after 1s"] + ["error: not run; a turn may make at most 1 python call(s)"] * 2
        assert elapsed < 2.5 and pool._workers[0].proc.pid == pid and pool._workers[0].proc.poll() is None
