"""The run folder (run.output_dir): every file and folder a run writes, named once.

    <output_dir>/
      .distflow-run       marks the folder as a distflow run's (written first by a fresh start)
      .distflow-lock      held by rank 0 while a run is live; names its host, pid and start time
      config.json         the resolved config (distflow.config.config_record)
      metrics.jsonl       one row of metrics per step (the jsonl logger)
      summary.json        held-out pass@1 before/after, wall time, the last reward
      training.png        the curves (distflow.metrics.plot)
      logs/rank_<r>.log   everything each rank logged
      checkpoints/step_NNNNNN/   (distflow.checkpoint.checkpointer)
      hf_model/  adapter/ the exported policy (checkpoint.export_at_end; adapter: LoRA)
      wandb/  wandb_run_id  tb/   the W&B and TensorBoard loggers' files
      previous/<time>/    an earlier run's files, set aside by a fresh start

Writers ask a `RunDir` for their paths. Before anything else touches the folder, rank 0 takes
an exclusive flock on .distflow-lock for the life of its process: a second launch into a live
run's folder stops with one line naming the holder, and the kernel drops the lock of a process
that dies however it dies, so a killed run leaves nothing that blocks the next launch.

Under torchrun the lock file also names the run (TORCHELASTIC_RUN_ID) and its agent (the rank's
parent, with its start time so that a reused pid is not mistaken for it). Between two attempts
of a restarted run no rank 0 holds the flock; a launch that takes it then but finds the record of
another run whose agent still lives on this host is refused as if the flock were held, while the
run's own next attempt takes the folder over: one started by the same agent (also after a node
joined, which restarts the ranks without counting a restart), or one with the same run id and
TORCHELASTIC_RESTART_COUNT > 0 (its rank 0 under another agent). An agent that is gone frees the
folder. A record written on another host cannot be checked from here
(its pids are that host's): there the gap between attempts stays open.

A fresh start in a folder that holds an earlier run moves exactly these artifacts to
previous/<time>/ and leaves every other file where it is (a launcher's logs/<job>-<node>.log and
launch.txt, Hydra's .hydra/, the user's own files). It writes what it moves into a journal in
previous/<time>/ first, so a launch that finds a set-aside cut short (SIGKILL, a lost node)
finishes that one instead of splitting the earlier run over two folders. A folder that holds
files under these names (previous/ included) but was not written by distflow is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from distflow.config import ConfigError
from distflow.run.output import write_failure_line

MARKER, LOCK, JOURNAL = ".distflow-run", ".distflow-lock", ".set-aside.json"
_held: dict[str, int] = {}  # the lock files this process holds (resolved path -> descriptor), for its life


def _close_held_in_child() -> None:
    """A forked child does not keep the folder locked after its parent is gone."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunDir:
    def __init__(self, root: str | Path):
        self.root = r = Path(root)
        self.marker, self.config, self.metrics = r / MARKER, r / "config.json", r / "metrics.jsonl"
        self.summary, self.plot, self.logs = r / "summary.json", r / "training.png", r / "logs"
        self.checkpoints, self.hf_model, self.adapter = r / "checkpoints", r / "hf_model", r / "adapter"
        self.validation = r / "validation"  # validation.save_samples' transcripts
        self.wandb, self.wandb_run_id, self.tensorboard = r / "wandb", r / "wandb_run_id", r / "tb"
        self.previous, self.lockfile = r / "previous", r / LOCK

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def artifacts(self) -> list[Path]:
        """The artifacts present now, the marker last (a set-aside cut short still marks the folder)."""
        fixed = [self.config, self.metrics, self.summary, self.plot, self.checkpoints, self.hf_model, self.adapter,
                 self.validation, self.wandb, self.wandb_run_id, self.tensorboard]
        found = [p for p in fixed if p.exists()]
        found += sorted(self.logs.glob("rank_*.log")) if self.logs.is_dir() else []
        return found + ([self.marker] if self.marker.exists() else [])

    # ------------------------------------------------------------------ the lock
    def lock(self) -> str | None:
        """Rank 0, first of all: create the folder and hold its lock for the life of this process (or
        until unlock). ConfigError (one line) when the folder cannot be created or written, or another
        live run holds it; a warning (returned) when its file system does not support locks."""
        key = str(self.lockfile.resolve())
        if key in _held:  # this process holds it already (a second plan in one process)
            return None
        self.created = missing_dirs(self.root)
        for _ in range(10):  # again when the holder removed the file as this launch opened it (unlock)
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lockfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                verb = "is not writable" if os.path.isdir(self.root) else "cannot be created"
                self.unlock()  # what mkdir created
                raise ConfigError(f"run.output_dir {self.root} {verb}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(_record(fd))
                os.close(fd)
                raise ConfigError(_in_use(self.root, holder)) from None
            except OSError as e:  # ENOLCK, ENOSYS: e.g. Lustre mounted without -o flock
                os.close(fd)
                return f"{self.lockfile} cannot be locked ({e.strerror}): a second run into this folder is not refused"
            if _same_file(fd, self.lockfile):
                break
            os.close(fd)
        else:
            raise ConfigError(f"run.output_dir {self.root} is in use: other launches keep taking its lock")
        if (record := _record(fd)) and _restarting(record):
            os.close(fd)  # the record stays: it is that run's
            self.created = []
            raise ConfigError(_in_use(self.root, _holder(record, restarting=True)))
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  **_this_torchrun()}
        _held[key] = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError as e:
            self.unlock()
            raise ConfigError(f"run.output_dir {self.root} is not writable: {write_failure_line(self.lockfile, e)}") \
                from None
        return None

    def check(self) -> str | None:
        """What lock() would stop this launch with (the same ConfigError), without keeping the lock or
        anything lock() created: for a pre-flight, before the ranks start."""
        if str(self.lockfile.resolve()) in _held:
            return None
        note = self.lock()
        self.unlock()
        return note

    def unlock(self) -> None:
        """Give the lock up: at the end of a run, or when a launch stops before it starts (then what
        lock() created goes too, so a refused folder is left as it was). A no-op where not held."""
        fd = _held.pop(str(self.lockfile.resolve()), None)
        if fd is not None:
            self.lockfile.unlink(missing_ok=True)  # while still held: a launch that opened it retries
            os.close(fd)
        for folder in getattr(self, "created", []):  # deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty, or never made
                break
        self.created = []

    # ------------------------------------------------------------------ ownership
    def written_by_distflow(self) -> bool:
        """The folder carries the marker, or (a run from before the marker) a distflow config.json,
        or (a set-aside's last step cut short) an earlier run in previous/."""
        if self.marker.is_file():
            return True
        try:
            record = json.loads(self.config.read_text())
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and {"model", "rollout", "algorithm"} <= record.keys():
            return True
        earlier = [p for p in self.previous.iterdir() if p.is_dir()] if self.previous.is_dir() else []
        return any((p / JOURNAL).is_file() or RunDir(p).written_by_distflow() for p in earlier)

    def claim(self) -> None:
        """Mark the folder as this run's (rank 0, before anything else is written)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps({"created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")

    def set_aside(self) -> Path | None:
        """Move an earlier run's artifacts to previous/<time>/ (None if there were none);
        ConfigError when the folder holds such names but distflow did not write them."""
        found = self.artifacts()
        named = found + [p for p in (self.previous,) if p.exists()]
        if named and not self.written_by_distflow():
            names = ", ".join(p.relative_to(self.root).as_posix() for p in named[:4])
            raise ConfigError(f"run.output_dir {self.root} holds files distflow did not write ({names}); "
                              "choose an empty or new folder")
        if not found:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest, n = self.previous / stamp, 1
        while dest.exists():
            n += 1
            dest = self.previous / f"{stamp}-{n}"
        dest.mkdir(parents=True)
        journal = dest / JOURNAL
        tmp = journal.with_name(JOURNAL + ".tmp")
        tmp.write_text(json.dumps({"moving": [p.relative_to(self.root).as_posix() for p in found]}))
        os.replace(tmp, journal)  # from here on a launch that finds the journal finishes this set-aside
        self._move(found, dest)
        journal.unlink()
        return dest

    def finish_set_aside(self) -> Path | None:
        """Finish a set-aside an earlier launch was stopped in (its journal is still there): move what
        it had not moved yet into the same previous/<time>/. Returns that folder (None: none found)."""
        if not self.previous.is_dir():
            return None
        finished = None
        for dest in sorted(p for p in self.previous.iterdir() if p.is_dir()):
            journal, tmp = dest / JOURNAL, dest / (JOURNAL + ".tmp")
            if tmp.exists():  # stopped before the journal was complete: nothing was moved
                tmp.unlink()
                if not journal.exists() and not any(dest.iterdir()):
                    dest.rmdir()
            if not journal.is_file():
                continue
            names = json.loads(journal.read_text())["moving"]
            self._move([self.root / name for name in names], dest)
            journal.unlink()
            finished = dest
        return finished

    def _move(self, paths: list[Path], dest: Path) -> None:
        """Move each path still in the folder to the same place under dest (each move a rename)."""
        for path in paths:
            target = dest / path.relative_to(self.root)
            if (path.exists() or path.is_symlink()) and not (target.exists() or target.is_symlink()):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), str(target))


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what creating it makes."""
    missing = []
    for folder in (path, *path.parents):
        try:
            os.stat(folder)
        except FileNotFoundError:
            missing.append(folder)
            continue
        except OSError:  # a name too long, a file in the way, no search permission: nothing is made there
            pass
        break
    return missing


def _record(fd: int) -> dict:
    """What the last holder wrote into the lock file ({} when nothing readable)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _holder(record: dict, restarting: bool = False) -> str:
    """Who holds the lock, as its holder wrote it into the lock file."""
    try:
        host, pid, started = record["host"], record["pid"], record["started"]
    except KeyError:
        return "a run that has not written its host and pid yet"
    agent = f"torchrun agent pid {record.get('agent_pid')}, run id {record.get('run_id')}"
    if restarting:
        return f"host {host}, {agent}: restarting its ranks"
    return f"host {host}, pid {pid}, started {started}" + (f", {agent}" if "run_id" in record else "")


def _in_use(root: Path, holder: str) -> str:
    return f"run.output_dir {root} is in use by another run ({holder}); wait for it to end, or choose another " \
        "run.output_dir"


def _this_torchrun() -> dict:
    """This rank's torchrun run and agent, for the lock record ({} outside torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return {}
    agent = os.getppid()  # torchrun's agent starts its ranks itself
    return {"run_id": run_id, "agent_pid": agent, "agent_start": _started(agent)}


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def _restarting(record: dict) -> bool:
    """The record is another torchrun run's, whose agent is alive on this host: that run is between
    two attempts (its rank 0 gone, the next not started yet), and its folder is still its own."""
    agent, start = record.get("agent_pid"), record.get("agent_start")
    if not isinstance(agent, int) or start is None or record.get("host") != socket.gethostname():
        return False  # not written under torchrun, or on another host: nothing to check from here
    if (agent, start) == (os.getppid(), _started(os.getppid())) and os.environ.get("TORCHELASTIC_RUN_ID"):
        return False  # this rank's own agent wrote it: a later attempt (after a failure, or a node joining)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and record.get("run_id") == os.environ.get("TORCHELASTIC_RUN_ID"):
        return False  # that run's next attempt, its rank 0 now under another agent
    return _started(agent) == start
