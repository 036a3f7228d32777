"""Test-only fault injection (trainer.fault_inject): how the tests make a rank die, raise or
produce NaN losses at a chosen step of a real run."""

from __future__ import annotations

import os
import signal

import torch

from distflow.batch import UpdateBatch


def inject_fault(spec: str, rank: int, step: int, batch: UpdateBatch) -> UpdateBatch:
    """Test-only: trainer.fault_inject="RANK:STEP[:kill|raise|nan]" fails that rank during that
    step ("STEP+" = that step and every later one), on the first attempt only (torchrun restarts
    set TORCHELASTIC_RESTART_COUNT). `nan` poisons the rank's advantages, so its loss is NaN."""
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return batch
    f_rank, f_step, *mode = spec.split(":")
    hit = step >= int(f_step[:-1]) if f_step.endswith("+") else step == int(f_step)
    if int(f_rank) != rank or not hit:
        return batch
    mode = (mode or ["kill"])[0]
    if mode == "nan":
        return batch.with_(advantages=torch.full_like(batch.advantages, float("nan")))
    if mode == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
    return batch
