"""Real small or read-only file systems for tests, without privileges: a tmpfs mounted in a user
and mount namespace of its own, held by a sleeping process and reached through /proc/<pid>/root
(so every process of the test, spawned ranks included, writes to the same mount). Root in a
container is not stopped by chmod; a read-only mount and a full disk stop anyone."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def private_tmpfs(where: Path, size: str = "256k", readonly: bool = False):
    """The path of a tmpfs of `size` (read-only: empty and unwritable), valid inside the block."""
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    holder = subprocess.Popen(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o {options} distflow-test {where} "
                               "&& echo mounted && exec sleep 600"], stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline().strip()
        assert line == "mounted", f"no tmpfs in a user+mount namespace here ({line!r})"
        yield Path(f"/proc/{holder.pid}/root") / where.resolve().relative_to("/")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def fill(directory: Path, name: str = "filler") -> Path:
    """Write into directory/name until its file system is full; returns that file."""
    path = directory / name
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
    return path
