"""The python tool: runs policy-written code in a sandbox (distflow.tasks.envs.sandbox: a read-only system, a private
/tmp, its own PID, user and network namespaces, an unprivileged uid, rlimits), killed with all of its processes
at the timeout, its output read bounded. Where no sandbox works it refuses to start, unless the environment
sets allow_unisolated: then the code runs as before sandboxes (rlimits, a network namespace where unshare works,
else an audit hook), with the worker's rights."""

from __future__ import annotations

import codecs
import ctypes
import logging
import math
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from distflow.config import ConfigError
from distflow.tasks.envs.cgroup import CallCgroup, MemoryCgroups, per_process_note
from distflow.tasks.envs.cgroup import find as find_cgroups
from distflow.tasks.envs.sandbox import MECHANISMS, Limits, Sandbox, SandboxUnavailable, base_env, capped, find
from distflow.tasks.envs.tools import ToolResult, check_output_limit, cut_text, error_result, string_argument

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
FILE_SIZE_LIMIT = 16 << 20  # bytes any one file the code writes may reach (RLIMIT_FSIZE)
TMP_SIZE = 64 << 20  # bytes of the sandbox's /tmp (a tmpfs: memory, beside the address-space limit)
# Processes (and threads) the code may run, set only inside its own user namespace: there the kernel counts
# the namespace's processes alone; outside it, RLIMIT_NPROC counts all of the user's processes, the worker's too.
# The kernel does not apply it to root: root's sandboxes run as uid 65534 (distflow.tasks.envs.sandbox).
PROCESS_LIMIT = 64
# Seconds a call may take beyond timeout_s: the sandbox's start-up (~0.05-0.2 s) and tear-down, with room for
# a loaded machine. ToolEnv adds it to timeout_s to check that a turn's calls fit in task.reward_timeout_s.
STARTUP_ALLOWANCE_S = 1.0
MAX_CODE_BYTES = 100_000  # one argv string may be at most 128 KiB (MAX_ARG_STRLEN)
_READ_CHUNK = 1 << 16
log = logging.getLogger("distflow")
_noted = False  # the per-process-only memory note is logged once per process

# Runs in the interpreter before the user code: argv = [code, "sandbox" or the worker's network namespace
# inode]. In the sandbox (started with -S: the standard library only) it restores exit() and help(). Without
# one, a different network namespace means unshare(CLONE_NEWNET) worked; otherwise an audit hook (which cannot
# be removed, and sees C-level calls, so it covers _socket too) refuses sockets and starting programs.
_BOOTSTRAP = r"""
import os, sys
code, worker_netns = sys.argv[1], sys.argv[2]
sys.argv = ["<code>"]
if sys.flags.no_site:
    import site
    site.setquit(), site.setcopyright(), site.sethelper()
try:
    isolated = worker_netns == "sandbox" or str(os.stat("/proc/self/ns/net").st_ino) != worker_netns
except OSError:
    isolated = False
if not isolated:
    import _socket
    try:
        import _posixsubprocess
    except ImportError:
        _posixsubprocess = None
    _spawn = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile", "pty.spawn"}
    _symbols = {"socket", "connect", "bind", "sendto", "sendmsg", "socketcall", "syscall", "getaddrinfo", "system",
                "popen", "posix_spawn", "posix_spawnp", "execve", "execv", "execvp", "execvpe", "execl", "execlp",
                "execle", "fexecve"}
    def _sandbox_hook(event, args, _unix=_socket.AF_UNIX):
        if event.startswith("socket."):
            if event == "socket.gethostname" or (event == "socket.__new__" and args[1] == _unix):
                return  # socketpair() (asyncio's self-pipe); connect/bind/sendto stay refused
            raise OSError("network is disabled in the sandbox")
        if event in _spawn:
            raise OSError("starting programs is disabled in the sandbox (no network isolation here)")
        if event == "ctypes.dlsym" and args[1] in _symbols:
            raise OSError(f"{args[1]} is disabled in the sandbox")
    def _refused(*args, **kwargs):
        raise OSError("starting programs is disabled in the sandbox (no network isolation here)")
    if _posixsubprocess is not None:
        _posixsubprocess.fork_exec = _refused
    sys.addaudithook(_sandbox_hook)
sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
sys.stderr.reconfigure(encoding="utf-8", errors="backslashreplace")
import linecache, traceback, types
linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
try:
    exec(compile(code, "<code>", "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    sys.stdout.flush()
    tb = e.__traceback__
    traceback.print_exception(type(e), e, tb.tb_next if tb is not None else None)
    sys.exit(1)
"""


def _unshare() -> Optional[Callable[[int], int]]:
    """libc's unshare(2), resolved in the worker so the forked child only calls it; None without one."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _netns_inode() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def _limit(kind: int, soft: int, hard: Optional[int] = None) -> tuple[int, int]:
    return capped(kind, soft, soft if hard is None else hard)


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: its pid, hence the process group id, stays reserved."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Head:
    """The first `limit` chars of a UTF-8 stream plus the count of the rest, in bounded memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.total = limit, 0, 0
        self.pieces: list[str] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        self.total += len(text)
        if self.kept < self.limit and text:
            piece = text[: self.limit - self.kept]
            self.pieces.append(piece)
            self.kept += len(piece)

    def text(self) -> str:
        self.add(b"", final=True)
        return cut_text("".join(self.pieces), self.total, self.limit)


class PythonExecutor:
    """Run a Python program in a fresh, limited subprocess and return what it printed (stdout + stderr merged).

    The program runs in a sandbox (distflow.tasks.envs.sandbox): the base interpreter's standard library only, a
    read-only system and a private 64 MiB /tmp as its working folder and HOME (nothing of the user's home, the
    project, the virtual environment or the run folder), its own PID namespace, no network, a minimal
    environment (PATH, LANG, LC_ALL, HOME), an unprivileged uid without capabilities, and rlimits on CPU time,
    address space, file size, core dumps and processes. All of its processes together, /tmp included, are held
    to memory_mib + 64 MiB by a per-call cgroup v2 where the machine allows one (distflow.tasks.envs.cgroup);
    elsewhere one start-up line says the bound is per process only (processes x memory_mib), and a call's
    processes die at its timeout. Going over the total ends the whole program, an "out of memory" observation.
    stdin is closed. At the end or at the timeout all of its processes are killed (the namespace's init exits; it also dies with the worker). Output beyond
    max_output_chars is read and counted but not kept, so a print loop cannot exhaust the worker's memory.

    Where no sandbox works (the probe runs once per process, when the tool is built) the tool refuses to
    start with a ConfigError, unless `allow_unisolated`: then it runs `python -I` as before sandboxes, with the
    worker's rights, in a temporary folder, its own session and the same rlimits; the network is blocked by a
    network namespace where unshare() works, else by a best-effort audit hook that code reaching raw system
    calls (ctypes, re-imported C modules) gets around.
    """

    name = "python"
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program; print what you need"}},
        "required": ["code"],
    }
    _mechanisms = MECHANISMS  # the sandbox mechanisms to try; () forces "none works" (tests)
    _try_netns = True  # unisolated only: False forces the audit-hook network block (tests)
    _cgroup_root = "/"  # where /proc/self/cgroup and the cgroup2 mount are read (tests: a fake tree)

    def __init__(self, timeout_s: float = 5.0, memory_mib: int = 512, max_output_chars: int = 2000,
                 allow_unisolated: bool = False) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"python tool timeout_s must be > 0, got {timeout_s}")
        if memory_mib < 32:
            raise ConfigError(f"python tool memory_mib must be >= 32 (the interpreter needs ~15), got {memory_mib}")
        check_output_limit(max_output_chars)
        self.timeout_s, self.memory_mib, self.max_output_chars = timeout_s, memory_mib, max_output_chars
        self.max_call_s = timeout_s + STARTUP_ALLOWANCE_S  # what one call may take, start-up included
        cpu = math.ceil(timeout_s) + 1
        try:
            self.sandbox: Optional[Sandbox] = find(self._mechanisms, Limits(
                cpu_s=cpu, memory_bytes=memory_mib << 20, file_bytes=FILE_SIZE_LIMIT, processes=PROCESS_LIMIT,
                tmp_bytes=TMP_SIZE))
        except SandboxUnavailable as e:
            if not allow_unisolated:
                raise ConfigError(
                    f"the python tool found no sandbox that works here ({e}); allow user namespaces or install "
                    "bubblewrap, or set task.env_args.allow_unisolated=true to run its code with this user's "
                    "rights (see docs/tasks.md)") from None
            self.sandbox = None
        where = "a sandbox (the standard library only" if self.sandbox else "a limited process (no sandbox"
        self.description = (
            f"Run a Python 3 program in a fresh process in {where}) and get back what it prints (stdout and "
            f"stderr). No network, no input, {timeout_s:g} s and {memory_mib} MiB at most; the output is cut "
            f"after {max_output_chars} characters. Nothing persists between calls."
        )
        self._limits = [
            (resource.RLIMIT_CPU, _limit(resource.RLIMIT_CPU, cpu, cpu + 1)),  # SIGXCPU, then SIGKILL
            (resource.RLIMIT_AS, _limit(resource.RLIMIT_AS, memory_mib << 20)),
            (resource.RLIMIT_FSIZE, _limit(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        self._nproc = _limit(resource.RLIMIT_NPROC, PROCESS_LIMIT)
        self._unshare = _unshare() if self._try_netns and self.sandbox is None else None
        self.total_memory_bytes = (memory_mib << 20) + TMP_SIZE  # its processes together, /tmp included
        self.cgroups: Optional[MemoryCgroups]
        self.cgroups, why = find_cgroups(self.total_memory_bytes, PROCESS_LIMIT, self._cgroup_root)
        if self.cgroups is None:
            # RLIMIT_NPROC holds where the sandbox's uid is not root outside: not bwrap run as root, not unisolated
            bounded = self.sandbox is not None and not (self.sandbox.mechanism == "bwrap" and os.getuid() == 0)
            _note_once(per_process_note(why, PROCESS_LIMIT if bounded else None, memory_mib << 20, TMP_SIZE))

    def _preexec(self, cgroup_procs: int = -1) -> None:
        """Unisolated only, in the forked child before exec: only pre-computed values and C calls (the worker may
        have threads). cgroup_procs: an open cgroup.procs to join first (-1: none)."""
        if cgroup_procs >= 0:
            os.write(cgroup_procs, b"0")
        isolated = self._unshare is not None and self._unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
        for kind, value in self._limits:
            resource.setrlimit(kind, value)
        if isolated:
            resource.setrlimit(resource.RLIMIT_NPROC, self._nproc)

    def __call__(self, arguments: dict) -> ToolResult:
        code = string_argument(arguments, "code")
        if isinstance(code, ToolResult):
            return code
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES or "\0" in code:
            return error_result(f"the code must be at most {MAX_CODE_BYTES} bytes, without NUL characters")
        try:
            call_cgroup = self.cgroups.make() if self.cgroups is not None else None
        except OSError as e:
            return error_result(f"could not start the sandbox: cannot make its memory cgroup: {e}")
        try:
            if self.sandbox is not None:
                prefix = call_cgroup.prefix() if call_cgroup else []
                return self._run(lambda: self.sandbox.popen(_BOOTSTRAP, [code, "sandbox"], base_env(), prefix),
                                 call_cgroup)
            with tempfile.TemporaryDirectory(prefix="distflow-python-", ignore_cleanup_errors=True) as cwd:
                return self._unisolated(code, cwd, call_cgroup)
        finally:
            if call_cgroup is not None:
                call_cgroup.close()

    def _unisolated(self, code: str, cwd: str, call_cgroup: Optional[CallCgroup]) -> ToolResult:
        procs = os.open(call_cgroup.procs, os.O_WRONLY | os.O_CLOEXEC) if call_cgroup else -1
        try:
            return self._run(lambda: subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, code, _netns_inode()],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                env={"PATH": os.environ.get("PATH", os.defpath)}, start_new_session=True,
                preexec_fn=lambda: self._preexec(procs),
            ), call_cgroup)
        finally:
            if procs >= 0:
                os.close(procs)

    def _run(self, start: Callable[[], subprocess.Popen], call_cgroup: Optional[CallCgroup]) -> ToolResult:
        try:
            proc = start()
        except (OSError, ValueError, SandboxUnavailable, subprocess.SubprocessError) as e:
            return error_result(f"could not start the sandbox: {e}")
        try:
            output, timed_out = self._collect(proc)
        finally:
            _kill_group(proc.pid)  # before reaping, so the group id cannot have been reused
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
        if call_cgroup is not None and call_cgroup.out_of_memory():
            reason = f"out of memory (all of its processes together may use {self.total_memory_bytes >> 20} MiB)"
            return ToolResult(_with_reason(reason, output), error=True)
        if timed_out:
            return ToolResult(_with_reason(f"timed out after {self.timeout_s:g}s", output), error=True, timed_out=True)
        returncode = proc.returncode if self.sandbox is None else self.sandbox.returncode(proc.returncode)
        if returncode == 0:
            return ToolResult(output)
        return ToolResult(_with_reason(_exit_reason(returncode), output), error=True)

    def _collect(self, proc: subprocess.Popen) -> tuple[str, bool]:
        """(the output, cut to the limit; whether the deadline passed) once the child has exited and its
        output is drained, or at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        head, fd = _Head(self.max_output_chars), proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        exited = eof = False
        while not (exited and eof):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return head.text(), True
            exited = exited or _exited(proc.pid)
            if eof:  # the child closed its output but still runs
                time.sleep(min(remaining, 0.01))
                continue
            if not poller.poll(0 if exited else max(1, int(min(remaining, 0.05) * 1000))):
                if exited:
                    break  # exited and nothing left to read (a straggler may still hold the pipe open)
                continue
            chunk = os.read(fd, _READ_CHUNK)
            if chunk:
                head.add(chunk)
            else:
                eof = True
        return head.text(), False


def _note_once(note: str) -> None:
    """At start-up, once per process: the trainer's rank logs it (rank 0 on the console); a task worker, whose
    logging is not set up, drops an INFO record."""
    global _noted
    if not _noted:
        _noted = True
        log.info(note)


def _exit_reason(returncode: int) -> str:
    if returncode > 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
    return f"killed by {name}{hint}"


def _with_reason(reason: str, output: str) -> str:
    return f"error: {reason}\n{output}" if output else f"error: {reason}"


# ---------------------------------------------------------------------------------------------------------------------
