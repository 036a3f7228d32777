"""Stopping cleanly when the cluster says so: a signal saves a checkpoint and exits.

SLURM signals a job before it kills it (`--signal=B:USR1@120`, or SIGTERM at the time limit),
and torchrun forwards SIGTERM (and SIGUSR1, when told to) to its ranks. A signal may reach one
rank or all of them, at any moment: the handler only sets a flag. At the next step boundary
the ranks agree through one all_reduce (`StepBoundary.decide`, which also carries the clock of
checkpoint.every_s), all save the same step, and every rank exits with EXIT_STOPPED.
A second signal changes nothing, and a save cut short by SIGKILL leaves only a `.tmp` folder
that resume never picks (distflow.checkpoint.checkpointer), so the last complete checkpoint survives.

The same all_reduce carries whether a rank's write into the run folder failed (a full disk
under its log or metrics.jsonl, distflow.run.output.note_write_failure): then every rank raises
the same RunAborted, naming the file and the free space, instead of one rank's traceback and the
others waiting in their next collective until its timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time

from distflow.distributed import all_reduce, barrier
from distflow.distributed.agreement import failed_rank, failure_code, raise_agreed
from distflow.errors import RunAborted
from distflow.run.output import pending_write_failure

log = logging.getLogger("distflow")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE_ENV = "DISTFLOW_STOP_FILE"  # rank 0 writes {"step", "checkpoint", "signal"} there when it stops
FREE_SPACE = "Free space and relaunch with the same run.output_dir to continue from its last checkpoint"


@dataclasses.dataclass(frozen=True)
class Stopped:
    step: int
    checkpoint: str | None  # None: stopped before the first save of a fresh run
    signal: str


class StopSignal:
    """Records STOP_SIGNALS; installed for the training loop, removed after it."""

    def __init__(self) -> None:
        self.name: str | None = None  # the first signal received
        self.count = 0
        self.first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignal":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:  # only flags: it may interrupt anything, a save included
        self.count += 1
        if self.name is None:
            self.name, self.first_at = signal.Signals(signum).name, time.monotonic()


class StepBoundary:
    """What all ranks do after a step: save (interval, clock, end, signal) and whether they stop;
    `stop` reports where they stopped."""

    def __init__(self, every_steps: int, every_s: float, at_end: bool):
        self.every_steps, self.every_s, self.at_end = every_steps, every_s, at_end
        self.last_save = time.monotonic()
        self.stopped: Stopped | None = None

    def decide(self, step: int, last: bool, stop: StopSignal) -> tuple[bool, bool]:
        """(save, stop), the same on every rank: one all_reduce(max) of [signalled, seconds since
        the last save, a failed write], so a signal seen by one rank and the slowest clock both count;
        RunAborted on every rank when a rank could not write into the run folder."""
        signalled, elapsed, failed = all_reduce(
            [float(stop.name is not None), time.monotonic() - self.last_save, _failed_write()], "max").tolist()
        stop_on_failed_write(failed, f"after step {step}")
        halt = bool(signalled) and not last  # a signal during the last step: the run just finishes
        save = (halt or (last and self.at_end) or (self.every_steps > 0 and step % self.every_steps == 0)
                or (self.every_s > 0 and float(elapsed) >= self.every_s))
        return save, halt

    def signalled(self, stop: StopSignal) -> bool:
        """Whether any rank has received a stop signal (collective; RunAborted as in decide)."""
        signalled, failed = all_reduce([float(stop.name is not None), _failed_write()], "max").tolist()
        stop_on_failed_write(failed, "before the first step")
        return bool(signalled)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def stop(self, step: int, checkpoint: str | None, stop: StopSignal, is_main: bool) -> None:
        """Every rank says where the run stopped; rank 0 writes the stop file for the launcher, and no
        rank exits before it can be read."""
        self.stopped = Stopped(step, checkpoint, stop.name or "a signal to another rank")
        where = f"with checkpoint {checkpoint}" if checkpoint else "with no checkpoint (nothing trained yet)"
        log.warning(f"{self.stopped.signal}: stopped after step {step} {where}; "
                    "relaunch with the same run.output_dir to resume")
        if is_main:
            write_stop_file(self.stopped)
        barrier()


def _failed_write() -> float:
    """rank + 1 when this rank could not write into the run folder since the last check, else 0."""
    return failure_code(pending_write_failure() is not None)


def stop_on_failed_write(failed: float, when: str) -> None:
    """Every rank raises the same RunAborted when `failed` (the all_reduced _failed_write) names a rank:
    that rank's line, broadcast from it (distflow.distributed.agreement)."""
    if failed:
        raise_agreed(failed_rank(failed, pending_write_failure(clear=True)), when, RunAborted, FREE_SPACE)


def write_stop_file(stopped: Stopped) -> None:
    """For the launcher that started us (launch/*): where the run stopped, once it is saved."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(stopped), f)
        os.replace(tmp, path)
