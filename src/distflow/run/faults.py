"""Test-only fault injection (run.fault_inject): how the tests make a rank die, raise, lag
behind the others or produce NaN losses at a chosen step of a real run, die or raise in the middle
of a checkpoint write, raise in the step's report, or leave a tensor out of a resync. The injector
is an observer of the run (distflow.metrics.timer): the trainer has no fault code of its own.

`raise` fails the rank where nothing agrees on it (its peers wait in their next collective until
torchrun stops them); `raise_saving` and `raise_report` raise inside regions the ranks agree on
(distflow.distributed.agreement), so every rank stops with that rank's line."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable

import torch

# the modes (distflow.config.run.FAULT_MODES) another hook than on_batch acts on
ELSEWHERE = ("kill_saving", "raise_saving", "raise_report", "stale_resync")


def _hit(spec: str, rank: int, step: int) -> str | None:
    """The fault's mode if `spec` names this rank and step (first attempt only), else None."""
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    f_rank, f_step, *mode = spec.split(":")
    hit = step >= int(f_step[:-1]) if f_step.endswith("+") else step == int(f_step)
    return (mode or ["kill"])[0] if int(f_rank) == rank and hit else None


class FaultInjector:
    """Test-only: run.fault_inject="RANK:STEP[:MODE]" (distflow.config.run.FAULT_MODES) fails that rank
    during that step ("STEP+" = that step and every later one), on the first attempt only (torchrun
    restarts set TORCHELASTIC_RESTART_COUNT)."""

    def __init__(self, spec: str, rank: int):
        self.spec, self.rank = spec, rank

    def on_batch(self, step: int, batch):
        """Before the update: `nan` poisons the rank's advantages, so its loss is NaN; `sleep=S` makes
        the rank S seconds slower (a straggler the others wait for); `raise` and `kill` fail it."""
        mode = _hit(self.spec, self.rank, step)
        if mode is None or mode in ELSEWHERE:
            return batch
        if mode.startswith("sleep="):
            time.sleep(float(mode.removeprefix("sleep=")))
            return batch
        if mode == "nan":
            return batch.with_(advantages=torch.full_like(batch.advantages, float("nan")))
        if mode == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
        return batch

    def before_checkpoint_marker(self, step: int) -> None:
        """"RANK:STEP:kill_saving": that rank dies by SIGKILL once every rank has written its shards of
        STEP's checkpoint and before the marker makes it complete, as when a grace period runs out
        mid-save; "RANK:STEP:raise_saving": that rank raises a RuntimeError there instead."""
        if (mode := _hit(self.spec, self.rank, step)) == "kill_saving":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise_saving":
            raise RuntimeError(f"injected fault on rank {self.rank} while saving step {step}")

    def on_step_end(self, step: int, metrics: dict) -> None:
        """"RANK:STEP:raise_report": that rank raises as STEP's metrics are written."""
        if _hit(self.spec, self.rank, step) == "raise_report":
            raise RuntimeError(f"injected fault on rank {self.rank} in the report of step {step}")

    def on_weights(self, step: int, weights: Iterable) -> Iterable:
        """"RANK:STEP:stale_resync": that rank's resync at STEP (the one after STEP's update, or the
        resume's when the run resumes from STEP) leaves out its first tensor, so the engine keeps a
        stale copy of it, as a broken resync would."""
        if _hit(self.spec, self.rank, step) != "stale_resync":
            return weights
        stream = iter(weights)
        next(stream, None)
        return stream
