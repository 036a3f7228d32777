"""Stopping cleanly when the cluster says so: a signal saves a checkpoint and exits.

SLURM signals a job before it kills it (`--signal=B:USR1@120`, or SIGTERM at the time limit),
and torchrun forwards SIGTERM (and SIGUSR1, when told to) to its ranks. A signal may reach one
rank or all of them, at any moment: the handler only sets a flag. At the next step boundary
the ranks agree through one all_reduce (`StepBoundary.decide`, which also carries the clock of
checkpoint.every_s), all save the same step, and every rank exits with EXIT_STOPPED.
A second signal changes nothing, and a save cut short by SIGKILL leaves only a `.tmp` folder
that resume never picks (distflow.run.checkpoint), so the last complete checkpoint survives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

from distflow.distributed import all_reduce

# The status of a rank that stopped on a signal after saving (EX_TEMPFAIL: try again later).
# Relaunching with the same output folder resumes. torchrun itself reports 1 for it; the
# launchers in launch/ turn that back into 75 through the stop file.
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE_ENV = "DISTFLOW_STOP_FILE"  # rank 0 writes {"step", "checkpoint", "signal"} there when it stops


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
    """What all ranks do after a step: save (interval, clock, end, signal) and whether they stop."""

    def __init__(self, every_steps: int, every_s: float, at_end: bool):
        self.every_steps, self.every_s, self.at_end = every_steps, every_s, at_end
        self.last_save = time.monotonic()

    def decide(self, step: int, last: bool, stop: StopSignal) -> tuple[bool, bool]:
        """(save, stop), the same on every rank: one all_reduce(max) of [signalled, seconds since
        the last save], so a signal seen by one rank and the slowest clock both count."""
        signalled, elapsed = all_reduce([float(stop.name is not None), time.monotonic() - self.last_save], "max")
        halt = bool(signalled) and not last  # a signal during the last step: the run just finishes
        save = (halt or (last and self.at_end) or (self.every_steps > 0 and step % self.every_steps == 0)
                or (self.every_s > 0 and float(elapsed) >= self.every_s))
        return save, halt

    def signalled(self, stop: StopSignal) -> bool:
        """Whether any rank has received a stop signal (collective)."""
        return bool(all_reduce(float(stop.name is not None), "max"))

    def saved(self) -> None:
        self.last_save = time.monotonic()


def write_stop_file(stopped: Stopped) -> None:
    """For the launcher that started us (launch/*): where the run stopped, once it is saved."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(stopped), f)
        os.replace(tmp, path)
