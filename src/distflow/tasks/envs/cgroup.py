"""A memory limit over all of a sandboxed program's processes together: a cgroup v2 per call.

RLIMIT_AS bounds each process alone, so a program that forks N processes may use N times it. Where the
machine lets this process make cgroups (cgroup2 mounted read-write, the memory controller reaching our
cgroup, and our cgroup or its parent ours to write: root, or delegated to our uid), each call gets a child
cgroup with `memory.max` (the program's memory plus its /tmp, a tmpfs charged to it), `memory.swap.max` 0,
`memory.oom.group` 1 (the OOM killer ends the whole program, not one of its processes) and `pids.max`
where the pids controller is on. The sandbox's first process joins it before it starts anything
(`CallCgroup.prefix`), and the cgroup is killed and removed when the call ends.

`detect` decides from the files alone (a root that tests point at a fake tree); `MemoryCgroups.check` then
makes and removes one cgroup for real. Where either fails, the caller logs `per_process_note` once: the
per-process limits stay, and the total they allow is stated. A cgroup v1 memory hierarchy is not used:
its children leave the cgroup that the machine's own process manager watches.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Optional

from distflow.tasks.envs.sandbox import interpreter

PREFIX = "distflow-python-"  # per-call cgroups are PREFIX<pid>-<n>; a dead pid's leftovers are removed
START_PROCESSES = 3  # beside the program's own: the sandbox's start-up process, its uid-map helper, its init
EMPTY_WAIT_S = 2.0  # how long a killed cgroup may take to empty before it is left for a later sweep

# Run by the base interpreter as `python -I -S -c _ENTER CGROUP_PROCS ARGV...`: moves itself into the call's
# cgroup, then becomes ARGV, so every process the sandbox starts is born inside it.
_ENTER = r"""
import os, sys
try:
    fd = os.open(sys.argv[1], os.O_WRONLY)
    os.write(fd, b"0")
    os.close(fd)
    os.execv(sys.argv[2], sys.argv[2:])
except OSError as e:
    os.write(2, f"sandbox: cannot join the memory cgroup: {e}\n".encode())
    os._exit(125)
"""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _words(path: str) -> set[str]:
    return {w.lstrip("+") for w in _read(path).split()}


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts(mountinfo: str) -> list[tuple[str, str, set[str], str, set[str]]]:
    """(root inside its file system, mount point, mount options, type, super options) per line of mountinfo."""
    out = []
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if len(parts) >= 6 and len(tail) >= 3:
            out.append((_unescape(parts[3]), _unescape(parts[4]), set(parts[5].split(",")), tail[0],
                        set(tail[2].split(","))))
    return out


def detect(root: str = "/", uid: Optional[int] = None) -> tuple[Optional[str], str]:
    """(the folder to make per-call cgroups in, "") where this process may, else (None, why not in a phrase).

    Reads <root>/proc/self/cgroup, <root>/proc/self/mountinfo and the cgroup2 tree below them. A folder is
    ours to write when `uid` (default: the effective uid) is root or owns it (a delegated cgroup). Our own
    cgroup serves when the memory controller is on for its children or it is the tree's root (which may
    hold processes and still enable it); else its parent, whose children have the memory controller."""
    uid = os.geteuid() if uid is None else uid
    lines = _read(os.path.join(root, "proc/self/cgroup")).splitlines()
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None, "cgroup v1 only"
    mounts = _mounts(_read(os.path.join(root, "proc/self/mountinfo")))
    mount = next((m for m in mounts if m[3] == "cgroup2"), None)
    if mount is None:
        return None, "no cgroup2 file system is mounted"
    mount_root, point, options = mount[:3]
    rel = os.path.relpath(path, mount_root)
    if rel == ".." or rel.startswith("../"):
        return None, f"our cgroup {path} is outside the cgroup2 mount at {point}"
    own = os.path.normpath(os.path.join(root, point.lstrip("/"), rel))
    if "ro" in options:
        return None, f"{point} is mounted read-only"
    if "memory" not in _words(os.path.join(own, "cgroup.controllers")):
        if any(m[3] == "cgroup" and "memory" in m[4] for m in mounts):
            return None, "the memory controller is on cgroup v1"
        return None, f"the memory controller is not enabled for our cgroup {path}"

    def ours(folder: str) -> bool:
        try:
            return uid == 0 or os.stat(folder).st_uid == uid
        except OSError:
            return False

    is_tree_root = not os.path.exists(os.path.join(own, "cgroup.type"))
    if ours(own) and ("memory" in _words(os.path.join(own, "cgroup.subtree_control")) or is_tree_root):
        return own, ""
    if rel != "." and ours(os.path.dirname(own)):
        return os.path.dirname(own), ""
    return None, f"our cgroup {path} cannot take a child with the memory controller here (not delegated to us)"


def settings(memory_bytes: int, processes: int, controllers: set[str]) -> dict[str, str]:
    """The files a call's cgroup is given, in order: all of its processes together, the start-up ones too."""
    out = {"memory.max": str(memory_bytes), "memory.swap.max": "0", "memory.oom.group": "1"}
    if "pids" in controllers:
        out["pids.max"] = str(processes + START_PROCESSES)
    return out


def per_process_note(reason: str, processes: Optional[int], memory_bytes: int, tmp_bytes: int) -> str:
    """The start-up line where no cgroup bounds the total (processes None: their number is not limited)."""
    mib, tmp = memory_bytes >> 20, tmp_bytes >> 20
    bound = (f"up to {processes} processes x {mib} MiB = {processes * mib} MiB, plus {tmp} MiB of /tmp"
             if processes else f"{mib} MiB each, plus {tmp} MiB of /tmp, and their number is not limited here")
    return f"python tool: no cgroup v2 memory limit here ({reason}); its programs' memory is bounded per " \
           f"process only: {bound}"


class CallCgroup:
    """One call's cgroup: its processes join it through `prefix`; `close` kills them and removes it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")

    def prefix(self) -> list[str]:
        """The command line's start that joins the cgroup, then execs the rest of the command line."""
        return [interpreter(), "-I", "-S", "-c", _ENTER, self.procs]

    def out_of_memory(self) -> bool:
        """Whether the OOM killer ended processes of the call (it ends all of them: memory.oom.group)."""
        events = dict(line.split(None, 1) for line in _read(os.path.join(self.path, "memory.events")).splitlines()
                      if " " in line)
        return any(int(events.get(k, "0")) > 0 for k in ("oom_kill", "oom_group_kill"))

    def _kill(self) -> None:
        if os.path.exists(os.path.join(self.path, "cgroup.kill")):
            _write(os.path.join(self.path, "cgroup.kill"), "1")
            return
        for word in _read(self.procs).split():  # kernels before 5.14: one by one
            if word.isdigit() and int(word) > 0:
                try:
                    os.kill(int(word), signal.SIGKILL)
                except OSError:
                    pass

    def close(self) -> None:
        """Kill whatever still runs in it, wait for it to empty, remove it (left for a later sweep if it won't)."""
        deadline = time.monotonic() + EMPTY_WAIT_S
        while True:
            try:
                self._kill()
            except OSError:
                pass
            if "populated 1" not in _read(os.path.join(self.path, "cgroup.events")) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class MemoryCgroups:
    """Makes per-call cgroups under `base` that hold a program to `memory_bytes` (and `processes`) in total."""

    def __init__(self, base: str, memory_bytes: int, processes: int) -> None:
        self.base, self.memory_bytes, self.processes = base, memory_bytes, processes
        self._names = itertools.count()

    def check(self) -> Optional[str]:
        """None when a cgroup can be made and removed here (enabling the controllers if need be), else why not.
        Removes the cgroups that processes which have died left behind."""
        for name in _stale(self.base):
            CallCgroup(os.path.join(self.base, name)).close()
        try:
            subtree = os.path.join(self.base, "cgroup.subtree_control")
            if "memory" not in _words(subtree):
                on = _words(os.path.join(self.base, "cgroup.controllers"))  # memory is among them (detect)
                _write(subtree, " ".join(f"+{c}" for c in ("memory", "pids") if c in on))
            self.make().close()
        except OSError as e:
            return f"cannot make a memory cgroup in {self.base}: {e.strerror or e}"
        return None

    def make(self) -> CallCgroup:
        """A fresh cgroup with its limits set; OSError when it cannot be made."""
        cgroup = CallCgroup(os.path.join(self.base, f"{PREFIX}{os.getpid()}-{next(self._names)}"))
        os.mkdir(cgroup.path)
        try:
            controllers = _words(os.path.join(self.base, "cgroup.subtree_control"))
            for name, value in settings(self.memory_bytes, self.processes, controllers).items():
                path = os.path.join(cgroup.path, name)
                if name != "memory.swap.max" or os.path.exists(path):  # absent without swap accounting
                    _write(path, value)
        except OSError:
            cgroup.close()
            raise
        return cgroup


def _stale(base: str) -> list[str]:
    """Per-call cgroups whose process is gone (it was killed during a call)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    out = []
    for name in names:
        pid = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            out.append(name)
    return out


_checked: dict[tuple[str, int, int], tuple[Optional[MemoryCgroups], str]] = {}


def find(memory_bytes: int, processes: int, root: str = "/") -> tuple[Optional[MemoryCgroups], str]:
    """(per-call cgroups, "") where they work here (checked once per process), else (None, why not)."""
    key = (root, memory_bytes, processes)
    if key not in _checked:
        base, why = detect(root)
        cgroups = MemoryCgroups(base, memory_bytes, processes) if base else None
        why = why or (cgroups.check() if cgroups else "") or ""
        _checked[key] = (None, why) if why else (cgroups, "")
    return _checked[key]
