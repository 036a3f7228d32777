"""Built-in tools a model can call during a multi-turn rollout.

A tool is called with the decoded "arguments" object of a tool call and never raises: bad arguments,
failures and timeouts come back as a ToolResult with error=True, whose output the model sees as the
observation. Outputs are cut to a character limit so one call cannot flood the context.
"""

from __future__ import annotations

import ast
import codecs
import ctypes
import math
import operator
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from distflow.config import ConfigError


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model sees (already truncated to the limit)
    error: bool = False  # the call failed (bad arguments, exception, non-zero exit)
    timed_out: bool = False


def _cut(head: str, total: int, limit: int) -> str:
    """`head` (at most `limit` chars of a text `total` chars long) plus the truncation marker when needed."""
    return head[:limit] if total <= limit else f"{head[:limit]}\n...[truncated {total - limit} chars]"


def truncate(text: str, limit: int) -> str:
    """text if len(text) <= limit, else the first `limit` chars + "\\n...[truncated N chars]" (N chars cut)."""
    return _cut(text, len(text), limit)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object (for the system prompt)

    def __call__(self, arguments: dict) -> ToolResult: ...


def _error(reason: str) -> ToolResult:
    return ToolResult(f"error: {reason}", error=True)


def _string_argument(arguments: object, key: str) -> str | ToolResult:
    """arguments[key] when it is a string, else the error result to return."""
    if not isinstance(arguments, dict) or key not in arguments:
        return _error(f'missing argument "{key}"')
    value = arguments[key]
    return value if isinstance(value, str) else _error(f'"{key}" must be a string, got {type(value).__name__}')


def _check_output_limit(max_output_chars: int) -> None:
    if max_output_chars < 1:
        raise ConfigError(f"tool max_output_chars must be >= 1, got {max_output_chars}")


# ---------------------------------------------------------------------------------------------------------------------
# calculator


class _CalcError(Exception):
    """A reason shown to the model as "error: <reason>"."""


MAX_DIGITS = 1000  # |int results| < 10**MAX_DIGITS: keeps every operation (and str()) cheap
MAX_EXPONENT = 1000
MAX_EXPRESSION_CHARS = 2000
_INT_BOUND = 10**MAX_DIGITS
_BITS_BOUND = _INT_BOUND.bit_length()

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: object) -> int | float:
    if isinstance(value, complex):
        raise _CalcError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _CalcError("the result is too large (not a finite number)")
    if isinstance(value, int) and abs(value) >= _INT_BOUND:
        raise _CalcError(f"the result has more than {MAX_DIGITS} digits")
    return value  # type: ignore[return-value]


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise _CalcError(f"exponent {exp} is too large (|exponent| <= {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and (abs(base).bit_length() - 1) * exp > _BITS_BOUND:
        raise _CalcError(f"the result has more than {MAX_DIGITS} digits")  # known before computing it
    return base**exp


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: excluded on purpose
            raise _CalcError(f"only numbers are allowed, got {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Name):
        raise _CalcError(f"unknown name {node.id!r}: only numbers and + - * / // % ** ( ) are allowed")
    what = type(getattr(node, "op", node)).__name__
    raise _CalcError(f"{what} is not allowed: only numbers and + - * / // % ** ( ) are allowed")


def _format_number(value: int | float) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


class Calculator:
    """Exact arithmetic by walking the expression's AST (never eval): a tool to check sums, not run code.

    Integers stay Python ints (exact); the exponent and the size of every intermediate result are bounded,
    so an expression like 9**9**9 is refused at once instead of hanging the worker.
    """

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly. Supports integers (exact, any size up to 1000 digits), "
        "decimals, + - * / // % ** and parentheses. No variables or functions."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression, e.g. (3 + 4) * 2**10"}},
        "required": ["expression"],
    }

    def __init__(self, max_output_chars: int = 2000) -> None:
        _check_output_limit(max_output_chars)
        self.max_output_chars = max_output_chars

    def __call__(self, arguments: dict) -> ToolResult:
        expression = _string_argument(arguments, "expression")
        if isinstance(expression, ToolResult):
            return expression
        if len(expression) > MAX_EXPRESSION_CHARS:
            return _error(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            value = _evaluate(ast.parse(expression.strip(), mode="eval"))
        except SyntaxError as e:
            return _error(e.msg if e.msg.startswith("invalid syntax") else f"invalid syntax: {e.msg}")
        except _CalcError as e:
            return _error(str(e))
        except ZeroDivisionError:
            return _error("division by zero")
        except OverflowError:
            return _error("the result is too large")
        except (RecursionError, MemoryError):
            return _error("the expression is nested too deeply")
        except ValueError as e:  # e.g. an integer literal beyond the str-conversion limit
            return _error(str(e).split(";")[0])
        return ToolResult(truncate(_format_number(value), self.max_output_chars))


# ---------------------------------------------------------------------------------------------------------------------
# python

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
FILE_SIZE_LIMIT = 16 << 20  # bytes any one file the code writes may reach (RLIMIT_FSIZE)
# Processes (and threads) the code may run, set only inside its own user namespace: there the kernel counts
# the namespace's processes alone; outside it, RLIMIT_NPROC counts all of the user's processes, the worker's too.
# The kernel does not apply it to root.
PROCESS_LIMIT = 64
MAX_CODE_BYTES = 100_000  # one argv string may be at most 128 KiB (MAX_ARG_STRLEN)
_READ_CHUNK = 1 << 16

# Runs in the sandboxed interpreter before the user code: argv = [code, the worker's network namespace inode].
# A different namespace means unshare(CLONE_NEWNET) worked; otherwise an audit hook (which cannot be removed,
# and sees C-level calls, so it covers _socket too) refuses sockets and starting programs.
_BOOTSTRAP = r"""
import os, sys
code, worker_netns = sys.argv[1], sys.argv[2]
sys.argv = ["<code>"]
try:
    isolated = str(os.stat("/proc/self/ns/net").st_ino) != worker_netns
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
    """(soft, hard) for setrlimit (hard defaults to soft), capped by the worker's own hard limit (a child's cannot
    exceed it)."""
    cap = resource.getrlimit(kind)[1]
    hard = soft if hard is None else hard
    return (soft, hard) if cap == resource.RLIM_INFINITY else (min(soft, cap), min(hard, cap))


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
        return _cut("".join(self.pieces), self.total, self.limit)


class PythonExecutor:
    """Run a Python program in a fresh, limited subprocess and return what it printed (stdout + stderr merged).

    The child runs `python -I` (no user site, no PYTHON* variables) with stdin closed, an empty temporary
    working directory (removed afterwards), PATH as its only environment variable, its own session (the whole
    process group is killed at the end, so stray children die too), and rlimits on CPU time, address space,
    file size and core dumps. The wall-clock timeout kills the group; output beyond max_output_chars is read
    and counted but not kept, so a print loop cannot exhaust the worker's memory.

    No network, two levels: (1) a real guarantee where the kernel allows unprivileged user namespaces: the
    child unshare()s a new user + network namespace before exec, so it has only a down loopback device and
    no route anywhere (also limiting it to PROCESS_LIMIT processes for non-root workers). (2) Otherwise
    (EPERM, e.g. Docker's default seccomp profile) a best-effort block: an audit hook installed before the
    user code refuses sockets (except socketpair), name lookups and starting programs; code that can reach
    raw syscalls (ctypes tricks, /proc/self/mem) could get around it. Neither isolates the filesystem: the
    code runs with the worker's file permissions, so run workers as an unprivileged user.
    """

    name = "python"
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program; print what you need"}},
        "required": ["code"],
    }
    _try_netns = True  # False forces the best-effort fallback (for tests of it)

    def __init__(self, timeout_s: float = 5.0, memory_mib: int = 512, max_output_chars: int = 2000) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"python tool timeout_s must be > 0, got {timeout_s}")
        if memory_mib < 32:
            raise ConfigError(f"python tool memory_mib must be >= 32 (the interpreter needs ~15), got {memory_mib}")
        _check_output_limit(max_output_chars)
        self.timeout_s, self.memory_mib, self.max_output_chars = timeout_s, memory_mib, max_output_chars
        self.description = (
            "Run a Python 3 program in a fresh sandboxed process and get back what it prints (stdout and stderr). "
            f"No network, no input, {timeout_s:g} s and {memory_mib} MiB at most; the output is cut after "
            f"{max_output_chars} characters. Nothing persists between calls."
        )
        cpu = math.ceil(timeout_s) + 1
        self._limits = [
            (resource.RLIMIT_CPU, _limit(resource.RLIMIT_CPU, cpu, cpu + 1)),  # SIGXCPU, then SIGKILL
            (resource.RLIMIT_AS, _limit(resource.RLIMIT_AS, memory_mib << 20)),
            (resource.RLIMIT_FSIZE, _limit(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        self._nproc = _limit(resource.RLIMIT_NPROC, PROCESS_LIMIT)
        self._unshare = _unshare() if self._try_netns else None

    def _preexec(self) -> None:
        """In the forked child before exec: only pre-computed values and C calls (the worker may have threads)."""
        isolated = self._unshare is not None and self._unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
        for kind, value in self._limits:
            resource.setrlimit(kind, value)
        if isolated:
            resource.setrlimit(resource.RLIMIT_NPROC, self._nproc)

    def __call__(self, arguments: dict) -> ToolResult:
        code = _string_argument(arguments, "code")
        if isinstance(code, ToolResult):
            return code
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES or "\0" in code:
            return _error(f"the code must be at most {MAX_CODE_BYTES} bytes, without NUL characters")
        with tempfile.TemporaryDirectory(prefix="distflow-python-", ignore_cleanup_errors=True) as cwd:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _BOOTSTRAP, code, _netns_inode()],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                    env={"PATH": os.environ.get("PATH", os.defpath)}, start_new_session=True,
                    preexec_fn=self._preexec,
                )
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                return _error(f"could not start the sandbox: {e}")
            try:
                output, timed_out = self._collect(proc)
            finally:
                _kill_group(proc.pid)  # before reaping, so the group id cannot have been reused
                proc.wait()
                proc.stdout.close()  # type: ignore[union-attr]
        if timed_out:
            return ToolResult(_with_reason(f"timed out after {self.timeout_s:g}s", output), error=True, timed_out=True)
        if proc.returncode == 0:
            return ToolResult(output)
        return ToolResult(_with_reason(_exit_reason(proc.returncode), output), error=True)

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

BUILTIN_TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonExecutor}


def build_tools(
    names: list[str], *, timeout_s: float = 5.0, memory_mib: int = 512, max_output_chars: int = 2000
) -> dict[str, Tool]:
    """The named built-in tools, by name; ConfigError for an unknown or repeated name."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"unknown tool {name!r}; the built-in tools are {', '.join(BUILTIN_TOOLS)}")
        if name in tools:
            raise ConfigError(f"tool {name!r} is listed twice")
        if name == "python":
            tools[name] = PythonExecutor(timeout_s=timeout_s, memory_mib=memory_mib, max_output_chars=max_output_chars)
        else:
            tools[name] = BUILTIN_TOOLS[name](max_output_chars=max_output_chars)
    return tools
