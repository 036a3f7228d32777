"""A trainer rank of a split run: the sync loop, with the rollout ranks' groups in and its weights out.

The loop is distflow.trainer.Trainer's, unchanged: only what it is built from differs. Its rollout is
a `RemoteRollout` (groups received, versions published), its engine probe is a `RemoteProbe` (the
engine that generates is on another rank), held-out validation runs on the trainers' own engines,
and the step boundary also tells the rollout set whether the run goes on; an error on a trainer
reaches its rollout set as its line.
"""

from __future__ import annotations

from distflow.distributed import all_reduce, enter_scope
from distflow.distributed.roles import RoleGroups
from distflow.errors import RunAborted
from distflow.pipeline.links import error_line
from distflow.pipeline.remote import RemoteRollout
from distflow.probe import EngineProbe, policy_logprobs
from distflow.run.preemption import StopSignal
from distflow.startup import Run
from distflow.trainer import Trainer


class RemoteProbe(EngineProbe):
    """The engine/policy probe of a split run, taken where the engines are. After a probed step's update
    (run.sync_probe_every) the step's first sequences and the policy's logprobs of them go to the
    rollout set with the step's control; a rollout rank compares its engine's logprobs once its engine
    holds that version with nothing running (where it applies the version, staged; where it applies the
    next one, inflight) and sends the largest gap with its next groups. So step s reports the gap of an
    earlier version (NaN when none came back: a version without weights, or the run's last ones), every
    trainer the largest of any rollout rank's, and past PROBE_LIMIT every rank stops with its line."""

    def __init__(self, remote: RemoteRollout, policy, cfg, pad_id: int):
        super().__init__(None, policy, cfg.run, cfg.model.dtype, pad_id)  # the engines are the rollout ranks'
        self.remote = remote

    def at_start(self, items: list) -> float:
        return 0.0  # the rollout ranks load the policy's checkpoint themselves: the first versions' probes check it

    def after_sync(self, step: int, samples, tokens) -> float | None:
        probed = self.probed(step, samples, tokens)
        if probed is not None:  # sent with no sequences too: a tensor-parallel group's ranks all join the probe
            seqs, rows = probed
            logprobs = policy_logprobs(self.policy, seqs, self.pad_id, rows) if seqs else []
            self.remote.probe_out = {"version": step, "seqs": seqs, "logprobs": [lp.tolist() for lp in logprobs]}
        gap, self.remote.probe_in = self.remote.probe_in, None
        diff = float(all_reduce(-1.0 if gap is None else gap, op="max")[0])  # every trainer, every step
        if diff < 0:
            return None
        self.judge(diff, f"step {step}, the rollout ranks' engines")
        return diff


class SplitTrainer(Trainer):
    def __init__(self, run: Run, stop_signal: StopSignal, groups: RoleGroups, observers: list | None = None):
        self.groups = groups
        super().__init__(run.cfg, observers, started=(run, stop_signal))

    def build_rollout(self) -> RemoteRollout:
        # the trainers' own rollout shards held-out validation over the trainers
        return RemoteRollout(self.cfg, super().build_rollout(self.groups.role_dist(self.dist)), self.groups)

    def build_probe(self) -> RemoteProbe:
        return RemoteProbe(self.rollout, self.learner.policy, self.cfg, self.run.pad_id)

    def train(self) -> None:
        """The sync loop; an error here reaches this trainer's rollout set as its line (a RunAborted's
        own, else naming this rank), so they stop with it instead of waiting out the deadline."""
        try:
            super().train()
        except RunAborted as e:
            self.rollout.abort(str(e))
            raise
        except Exception as e:
            self.rollout.abort(error_line(self.dist.rank, e))
            raise

    def evaluate(self, tag: str) -> dict[str, float]:
        """Held-out validation on the trainers' own engines, asleep otherwise: the policy's weights go into
        them for it (a collective over the trainers, as the resync's gather), while the rollout ranks go
        on generating."""
        local = self.rollout.local
        if self.learner.sends_adapter:
            local.load_adapter(*self.learner.adapter(), self.step)
        else:
            local.load_weights(self.learner.weights(), self.step)
        try:
            return local.evaluate(tag)
        finally:
            local.sleep()

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
