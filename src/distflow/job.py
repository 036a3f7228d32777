"""What a rank runs: the trainer, or in a split run (pipeline.mode=split) the role its rank number gives it.

Every rank starts the run the same way (distflow.startup: process group, plan, resume decision); a
split run then creates the roles' groups on every rank (distflow.distributed.roles) and builds a
`SplitTrainer` on the first ranks and a `RolloutRank` on the last `pipeline.rollout_ranks`. Each has
`train()`, `close()` and `stopped`, so the recipe drives either.
"""

from __future__ import annotations

from distflow.config import ConfigError, DistflowConfig
from distflow.run.preemption import StopSignal
from distflow.startup import start_run
from distflow.trainer import Trainer


def build_job(cfg: DistflowConfig, observers: list | None = None):
    """This rank's part of the run: a Trainer, a SplitTrainer or a RolloutRank."""
    stop_signal = StopSignal()
    run = start_run(cfg, stop_signal)  # may stop here (a config error, a finished run)
    if run.cfg.pipeline.mode != "split":
        return Trainer(run.cfg, observers, started=(run, stop_signal))
    from distflow.distributed.roles import take_roles
    from distflow.pipeline.rollout_rank import RolloutRank
    from distflow.pipeline.split_trainer import SplitTrainer

    layout = run.plan.layout
    per_step = run.cfg.data.prompts_per_rank * layout.trainers
    if per_step % layout.rollout_ranks:  # the same line on every rank, before any group or model
        raise ConfigError(f"pipeline.rollout_ranks={layout.rollout_ranks} does not divide the {per_step} prompts "
                          f"of a step (data.prompts_per_rank x {layout.trainers} trainer ranks)")
    groups = take_roles(layout, run.dist.backend)
    if groups.is_trainer:
        return SplitTrainer(run, stop_signal, groups, observers)
    if run.cfg.pipeline.apply == "inflight":
        from distflow.pipeline.inflight import InflightRolloutRank

        return InflightRolloutRank(run, stop_signal, groups, observers)
    return RolloutRank(run, stop_signal, groups, observers)
