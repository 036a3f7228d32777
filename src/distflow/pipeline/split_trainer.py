"""A trainer rank of a split run: the sync loop, with the rollout ranks' groups in and its weights out.

The loop is distflow.trainer.Trainer's, unchanged: only what it is built from differs. Its rollout is
a `RemoteRollout` (groups received, versions published), its engine probe is skipped (the engine that
generates is on another rank), and the step boundary also tells the rollout set whether the run goes
on; a RunAborted on a trainer reaches its rollout set as that line.
"""

from __future__ import annotations

from distflow.distributed import enter_scope
from distflow.distributed.roles import RoleGroups
from distflow.errors import RunAborted
from distflow.pipeline.remote import RemoteRollout
from distflow.run.preemption import StopSignal
from distflow.startup import Run
from distflow.trainer import Trainer


class SkippedProbe:
    """The engine/policy probe of a split run: not taken (the trainers' engines hold no weights)."""

    def at_start(self, items: list) -> float:
        return 0.0

    def after_sync(self, step: int, samples, tokens) -> None:
        return None


class SplitTrainer(Trainer):
    def __init__(self, run: Run, stop_signal: StopSignal, groups: RoleGroups, observers: list | None = None):
        self.groups = groups
        super().__init__(run.cfg, observers, started=(run, stop_signal))

    def build_rollout(self) -> RemoteRollout:
        return RemoteRollout(self.cfg, super().build_rollout(), self.groups)

    def build_probe(self) -> SkippedProbe:
        return SkippedProbe()

    def train(self) -> None:
        try:
            super().train()
        except RunAborted as e:
            self.rollout.abort(str(e))
            raise

    def stop_at_start(self) -> bool:
        if stopping := super().stop_at_start():
            self.rollout.control(self.step, halt=True)
        return stopping

    def close(self) -> None:
        super().close()
        enter_scope(None)  # this process's next run (tests, notebooks) starts on the whole world again

    def end_step(self) -> bool:
        """The step boundary (a rollout rank's signal counts as this rank's), then the rollout set's control."""
        if self.rollout.signalled and self.stop_signal.name is None:
            self.stop_signal.name = "a signal to a rollout rank"
        halt = super().end_step()
        self.rollout.control(self.step, halt)
        return halt
