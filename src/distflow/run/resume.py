"""Which run an output folder holds, and what this launch does with it (checkpoint.resume).

  auto    Continue the newest complete checkpoint if the same run wrote it: its saved config
          equals this one apart from the operational keys (resources, logging and checkpoint
          cadence, which a requeued or resized job may change; distflow.config marks them). A
          different run stops with one line that says what differs. A run already at run.steps
          says so and exits 0 without training. No checkpoint: a fresh start.
  never   A fresh start.
  force   Continue the newest checkpoint whatever differs (the differences are logged), e.g.
          a finished run with run.steps raised. No checkpoint: a fresh start.
  <path>  Continue that checkpoint, as force does.

A restarted torchrun attempt or a requeued SLURM job continues what its launch wrote, also under
`never`. A fresh start moves an earlier run's files to <output_dir>/previous/<time>/ (RunDir), so
two runs never mix in one metrics.jsonl. Rank 0 first locks the folder (a live run's folder, or
one that cannot be created or written, stops here) and finishes a set-aside an earlier launch was
cut short in; then it decides and moves. Every rank gets the plan, or the same error.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from distflow.errors import RunComplete
from distflow.config import ConfigError, DistflowConfig, config_differences, config_record
from distflow.distributed import DistInfo, broadcast_object, shutdown
from distflow.checkpoint.checkpointer import checkpoint_defect, latest_checkpoint, read_marker
from distflow.run.output import write_failure_line
from distflow.run.rundir import RunDir

RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    checkpoint: str | None = None  # None: a fresh start
    saved_world_size: int = 0
    set_aside: str | None = None  # where an earlier run's files went
    warnings: tuple[str, ...] = ()  # for the run's log, once it is set up


def launch_restart(env=os.environ) -> int:
    """> 0 when this process belongs to a restarted torchrun attempt or a requeued SLURM job."""
    return max(int(env.get(v, "0") or 0) for v in RESTART_VARS)


def plan_resume(cfg: DistflowConfig, restart: int = 0) -> ResumePlan:
    """Rank 0 only: lock the folder, read it and decide (ConfigError / RunComplete when it must stop)."""
    run = RunDir(cfg.run.output_dir)
    notes = tuple(filter(None, [run.lock()]))  # first of all: the folder is this process's from here on
    try:
        if finished := run.finish_set_aside():
            notes += (f"an earlier launch was stopped while it moved a run's files to {finished}; "
                      "it is finished now",)
        plan = _plan(run, cfg, restart)
    except OSError as e:  # a full disk, a file system gone read-only
        run.unlock()
        raise ConfigError(f"run.output_dir {run.root}: {write_failure_line(e.filename or run.root, e)}") from None
    except BaseException:
        run.unlock()
        raise
    return dataclasses.replace(plan, warnings=notes + plan.warnings)


def _plan(run: RunDir, cfg: DistflowConfig, restart: int) -> ResumePlan:
    mode = cfg.checkpoint.resume
    mode = "auto" if mode == "never" and restart > 0 else mode
    skipped: list[tuple[Path, int, str]] = []
    if mode in ("auto", "force"):
        found = latest_checkpoint(run.checkpoints, skipped)
    elif mode == "never":
        found = None
    else:
        found = Path(mode)
        if (defect := checkpoint_defect(found)) is not None:
            raise ConfigError(f"checkpoint.resume={mode!r} is not a complete checkpoint folder: {defect}")
    if found is None and skipped and mode == "force":
        path, _, defect = skipped[0]
        raise ConfigError(f"checkpoint.resume=force: no complete checkpoint in {run.checkpoints}; the newest, "
                          f"{path}, cannot be loaded: {defect}")
    torn = tuple(f"skipping checkpoint {path} (step {step}): {defect}" for path, step, defect in skipped)
    if found is None:
        moved = run.set_aside()
        run.claim()
        note = (f"{run.root} held files of an earlier run; they were moved to {moved}",) if moved else ()
        fresh = ("no complete checkpoint to continue: starting a fresh run at step 1",) if torn else ()
        return ResumePlan(set_aside=str(moved) if moved else None, warnings=torn + fresh + note)
    marker = read_marker(found)
    diffs = config_differences(marker["config"], config_record(cfg))
    if diffs and mode == "auto":
        raise ConfigError(
            f"{run.root} holds a different run ({'; '.join(diffs)}). Start a new run with checkpoint.resume=never "
            f"(the earlier one moves to {run.previous}/) or another run.output_dir; continue the earlier one with "
            "these settings with checkpoint.resume=force")
    if marker["step"] >= cfg.run.steps:
        raise RunComplete(
            f"{found} is already at step {marker['step']} of run.steps={cfg.run.steps}; nothing to train (results: "
            f"{run.summary}). Start a new run with checkpoint.resume=never, or continue this one with a higher "
            "run.steps and checkpoint.resume=force")
    note = (f"continuing {found} with other settings than it was written with: {'; '.join(diffs)}",) if diffs else ()
    if torn:  # what passing over them costs
        lost = skipped[0][1] - marker["step"]
        torn += (f"resuming from {found} (step {marker['step']}): {lost} step{'s' if lost != 1 else ''} "
                 "will be computed again",)
    return ResumePlan(str(found), int(marker["world_size"]), warnings=torn + note)


def agree_on_plan(cfg: DistflowConfig, dist: DistInfo) -> ResumePlan:
    """Collective: rank 0 plans (distflow.run.resume), every rank gets the plan or raises the
    same error (a ConfigError, or RunComplete when there is nothing to do)."""
    outcome: ResumePlan | Exception | None = None
    if dist.is_main:
        try:
            outcome = plan_resume(cfg, launch_restart())
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
            outcome = e
    outcome = broadcast_object(outcome)
    if isinstance(outcome, Exception):
        if dist.owns_group:
            shutdown()
        raise outcome
    return outcome
