"""A sandbox for code the policy wrote (the python tool): the program sees a fresh root holding only the
system's folders and the base interpreter, read-only, plus a small private /tmp (its working folder and
HOME); it runs in its own PID, mount, user, network (a down loopback only), IPC and UTS namespaces, as an
unprivileged uid without capabilities, under rlimits, and every process of it is gone when the call ends or
the process that started it dies.

Two mechanisms, tried in this order by `find()` (a real probe, once per process):

- "namespaces": `_INIT`, a small trusted start-up program run by the base interpreter, calls unshare(2)
  through ctypes, builds the root (a tmpfs, read-only bind mounts, a fresh /proc, a few device nodes,
  pivot_root) and starts the program as process 2 of the new PID namespace, itself staying as its init.
  Written here rather than composed from util-linux unshare(1) because unshare(1) can map root only onto
  root (mapping it onto `nobody` needs the setuid newuidmap helper) and cannot assemble a read-only root
  without a shell script in between. As root, the sandbox's uid is 65534 outside too, so the kernel applies
  RLIMIT_NPROC (it exempts processes whose real uid is root) and the program has neither root's file rights
  nor its signal rights; an ordinary user keeps its own uid (rlimits count per user namespace since 5.14).
- "bwrap": bubblewrap, when the namespaces above do not work here (e.g. kernels that allow user namespaces
  only to programs with a profile, as Ubuntu 24.04's AppArmor does) and `bwrap` is on PATH. It keeps the
  caller's uid outside: run as root, RLIMIT_NPROC does not apply to its programs; and its /tmp has no size
  limit (bwrap's --size is recent).

The program is the base interpreter (`sys._base_executable`, not the virtual environment's) started with
`-I -S`: the standard library only. Limits (CPU seconds, address space, file size, no core files, processes)
are set by a prelude inside the sandbox before the program runs, so the process limit counts that namespace
alone; the program cannot raise them (no capability outside its namespace). Their sum over all of its
processes is bounded by a cgroup v2 where the machine allows one (distflow.tasks.envs.cgroup), else only
per process.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

SANDBOX_ID = 65534  # the uid and gid root's sandboxes run as (nobody), inside and outside
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
MECHANISMS = ("namespaces", "bwrap")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203,
               "s390x": 217}  # pivot_root(2) has no libc wrapper: its syscall number per machine
PROBE_TIMEOUT_S = 20.0

# The "namespaces" mechanism's start-up, run as `python -I -S -c _INIT CONFIG ARGV...`. Three processes:
# this one (the worker's child; it unshares, drops to the sandbox uid, and reports the program's exit status
# as its own), its child (pid 1 of the new PID namespace: builds the root, starts the program, reaps; its exit
# kills whatever is left in the namespace) and the program (pid 2). Each dies with its parent (PDEATHSIG).
# A failure of the start-up itself is one "sandbox: ..." line on stderr and exit status 125.
_INIT = r"""
import ctypes, json, os, re, resource, select, signal, struct, sys
cfg, argv = json.loads(sys.argv[1]), sys.argv[2:]
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = (0x20000, 0x2000000, 0x4000000, 0x8000000,
                                                             0x10000000, 0x20000000, 0x40000000)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NOATIME, NODIRATIME, RELATIME, STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

def die(what):
    os.write(2, f"sandbox: {what}\n".encode())
    os._exit(125)

def check(ret, what):
    if ret != 0:
        die(f"{what}: {os.strerror(ctypes.get_errno())}")

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")

def kept_flags(path):
    # A remount inside a user namespace must keep the flags the mount came with (nosuid, nodev, noexec, atime).
    f = os.statvfs(path).f_flag
    flags = f & (NOSUID | NODEV | NOEXEC) | (NOATIME if f & 1024 else 0) | (NODIRATIME if f & 2048 else 0)
    return flags | (RELATIME if f & 4096 else 0 if f & 1024 else STRICTATIME)

def read_only(path):
    # The bind mount at path and every mount below it (a recursive bind copies them read-write).
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]
    for point in [path] + [p for p in points if p.startswith(path + "/")]:
        mount(None, point, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | kept_flags(point))

def build_root(new):
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
    for fd, path in zip(fds, cfg["binds"]):
        os.makedirs(new + path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", new + path, None, BIND | REC)
        read_only(new + path)
    for link, target in cfg["links"].items():
        os.symlink(target, new + link)
    os.mkdir(new + "/proc")
    mount("proc", new + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.mkdir(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", NOSUID | NOEXEC, "mode=0755,size=64k")
    for name in cfg["devices"]:
        open(new + "/dev/" + name, "w").close()
        mount("/dev/" + name, new + "/dev/" + name, None, BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, new + "/dev/" + name)
    os.mkdir(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", NOSUID | NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    os.chdir(new)
    check(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")  # the old root now lies under "."
    check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    libc.sethostname(b"sandbox", 7)

uid, gid, me = os.getuid(), os.getgid(), os.getpid()
inner = (cfg["id"], cfg["id"]) if uid == 0 else (uid, gid)  # the sandbox's uid and gid, the same on both sides
if uid == 0:  # only a process outside the new namespace, with CAP_SETUID there, may map it onto another uid
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(go_w)
        if os.read(go_r, 1) == b"1":
            try:
                for name, id in (("uid_map", inner[0]), ("gid_map", inner[1])):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(f"{id} {id} 1")
                os._exit(0)
            except OSError:
                pass
        os._exit(1)
    os.close(go_r)
check(libc.unshare(NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET), "unshare")
if uid == 0:
    os.write(go_w, b"1")
    if os.waitpid(helper, 0)[1] != 0:
        die("could not write the user namespace's uid and gid maps")
    os.setgroups([])
else:
    for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(line)
# Opened in the new mount namespace with the caller's rights (the sandbox uid may not reach them, e.g. ~/.pyenv)
fds = [os.open(path, os.O_PATH | os.O_CLOEXEC) for path in cfg["binds"]]
os.setresgid(*[inner[1]] * 3)
os.setresuid(*[inner[0]] * 3)
check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")  # after the uid change, which clears it
if os.getppid() != cfg["parent"]:
    os._exit(125)  # the caller has gone already
status_r, status_w = os.pipe()
alive_r, alive_w = os.pipe()
init = os.fork()
if init == 0:  # pid 1 of the new PID namespace
    os.close(status_r)
    os.close(alive_w)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(125)  # end of file: the parent is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program may signal its init: nothing but SIGCHLD counts
    build_root("/tmp")
    os.chdir("/tmp")
    program = os.fork()
    if program == 0:
        try:
            for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(s, signal.SIG_DFL)
            check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
            os.execv(argv[0], argv)  # a non-root uid: the exec drops every capability
        except OSError as e:
            die(f"cannot start {argv[0]}: {e}")
    while True:
        pid, status = os.wait()
        if pid == program:
            break
    os.write(status_w, struct.pack("i", status))
    os._exit(0)  # the kernel kills whatever else still runs in the namespace
os.close(status_w)
os.close(alive_r)
os.waitpid(init, 0)
data = os.read(status_r, 4)
if len(data) != 4:
    die("the sandbox's init process ended early")
status = struct.unpack("i", data)[0]
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(me, sig)
    os._exit(128 + sig)
os._exit(os.waitstatus_to_exitcode(status))
"""


@dataclass(frozen=True)
class Limits:
    """Per-process rlimits of a sandboxed program, plus the size of its /tmp (a tmpfs: memory)."""

    cpu_s: int
    memory_bytes: int
    file_bytes: int
    processes: int
    tmp_bytes: int


class SandboxUnavailable(Exception):
    """No isolating mechanism works here; the message says why, in one line."""


def interpreter() -> str:
    """The base interpreter (a virtual environment's python is a link to it, with site-packages we hide)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _layout() -> tuple[list[str], dict[str, str]]:
    """(folders bound read-only at the same path, symlinks {path: target}) of the sandbox's root."""
    binds, links = [], {}
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    for extra in (os.path.realpath(sys.base_prefix), os.path.dirname(interpreter())):
        if not any(extra == b or extra.startswith(b + "/") for b in binds):
            binds.append(extra)
    return binds, links


def capped(kind: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft, hard) for setrlimit, capped by this process's own hard limit (a child's cannot exceed it)."""
    cap = resource.getrlimit(kind)[1]
    return (soft, hard) if cap == resource.RLIM_INFINITY else (min(soft, cap), min(hard, cap))


def prelude(limits: Limits) -> str:
    """Python lines that set the limits, run inside the sandbox before the program."""
    values = [
        (resource.RLIMIT_CPU, *capped(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1)),  # SIGXCPU first
        (resource.RLIMIT_AS, *capped(resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, *capped(resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes)),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, *capped(resource.RLIMIT_NPROC, limits.processes, limits.processes)),
    ]
    return f"import resource\nfor _k, _s, _h in {values!r}:\n    resource.setrlimit(_k, (_s, _h))\ndel _k, _s, _h\n"


class Sandbox:
    """Starts programs in the sandbox with one mechanism ("namespaces" or "bwrap")."""

    def __init__(self, mechanism: str, limits: Limits) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown sandbox mechanism {mechanism!r}; known: {', '.join(MECHANISMS)}")
        self.mechanism, self.limits = mechanism, limits
        self._binds, self._links = _layout()
        self._prelude = prelude(limits)

    def argv(self, program: str, args: list[str]) -> list[str]:
        """The command line that runs `python -I -S -c program args...` (limits prepended) in the sandbox."""
        inner = [interpreter(), "-I", "-S", "-c", self._prelude + program, *args]
        if self.mechanism == "bwrap":
            return self._bwrap(inner)
        pivot_root = _PIVOT_ROOT.get(platform.machine())
        if pivot_root is None:
            raise SandboxUnavailable(f"pivot_root's system call number on {platform.machine()} is not known")
        config = {"parent": os.getpid(), "id": SANDBOX_ID, "binds": self._binds, "links": self._links,
                  "devices": DEVICES, "tmp_bytes": self.limits.tmp_bytes, "pivot_root": pivot_root}
        return [interpreter(), "-I", "-S", "-c", _INIT, json.dumps(config), *inner]

    def _bwrap(self, inner: list[str]) -> list[str]:
        argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL"]
        if os.getuid() == 0:
            argv += ["--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID)]
        for path in self._binds:
            argv += ["--ro-bind", path, path]
        for link, target in self._links.items():
            argv += ["--symlink", target, link]
        return [*argv, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp", "--", *inner]

    def returncode(self, returncode: int) -> int:
        """The program's exit status as subprocess gives it (-N: killed by signal N); bwrap reports 128 + N."""
        return -(returncode - 128) if self.mechanism == "bwrap" and 128 < returncode < 160 else returncode

    def popen(self, program: str, args: list[str], env: dict[str, str], prefix: Sequence[str] = ()
              ) -> subprocess.Popen:
        """The started sandbox: stdin /dev/null, stdout and stderr merged into one pipe, its own session (kill
        the process group to end it). `prefix` runs first and execs the rest (joining a memory cgroup:
        distflow.tasks.envs.cgroup). Raises OSError or SandboxUnavailable when it cannot start."""
        return subprocess.Popen([*prefix, *self.argv(program, args)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True)


def base_env() -> dict[str, str]:
    """The whole environment a sandboxed program gets."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp"}


_PROBE = "import os\nprint(os.getpid(), len(os.listdir('/proc/self/fd')) > 0, flush=True)\n"
_found: dict[str, Optional[str]] = {}  # mechanism -> why it does not work here (None: it works)


def _probe(mechanism: str) -> Optional[str]:
    """None when the mechanism runs a trivial program here as it should, else why not (one line)."""
    if mechanism == "bwrap" and shutil.which("bwrap") is None:
        return "bwrap is not on PATH"
    sandbox = Sandbox(mechanism, Limits(cpu_s=10, memory_bytes=512 << 20, file_bytes=1 << 20, processes=16,
                                        tmp_bytes=1 << 20))
    try:
        proc = subprocess.run(sandbox.argv(_PROBE, []), stdin=subprocess.DEVNULL, capture_output=True, env=base_env(),
                              cwd="/", timeout=PROBE_TIMEOUT_S, start_new_session=True)
    except (OSError, SandboxUnavailable, subprocess.SubprocessError) as e:
        return f"{mechanism}: {e}"
    out = (proc.stdout + proc.stderr).decode("utf-8", "replace").strip()
    if proc.returncode != 0 or out != "2 True":  # pid 2: its own PID namespace, under an init
        return f"{mechanism}: {out.splitlines()[-1] if out else f'exit status {proc.returncode}'}"
    return None


def find(mechanisms: tuple[str, ...], limits: Limits) -> Sandbox:
    """The first mechanism that works here (probed once per process), or SandboxUnavailable saying why not."""
    reasons = []
    for mechanism in mechanisms:
        if mechanism not in _found:
            _found[mechanism] = _probe(mechanism)
        if _found[mechanism] is None:
            return Sandbox(mechanism, limits)
        reasons.append(_found[mechanism])
    raise SandboxUnavailable("; ".join(reasons) or "no mechanism allowed")
