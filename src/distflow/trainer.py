"""The RL loop, identical on every rank: collect (generate -> balance -> score) -> logprobs ->
advantages -> update -> sync weights -> log -> checkpoint (or stop, on a signal).

There is no controller. Each rank samples its own prompts, generates all samples of a group
locally (so group statistics need no communication), and joins the others only through
FSDP's collectives and a few small all_reduces (global counts, batch statistics, metrics).
The trainer drives components and decides nothing they can decide themselves: the `Rollout`
(engine, data shard, the task's workers), the `Learner` (policy, reference, critic, updater),
the `Validator` (when held-out evaluation runs), the checkpointer and the step boundary (when to
save or stop). Observers (distflow.metrics.timer) watch phases from outside: benchmarks and
test-only fault injection never patch this class. Algorithms differ only in the functions the
config selects (distflow.algorithms.registry).

A rank that raises where its peers do not would leave them in their next collective until its
timeout. The step's rank-local regions therefore run under `one_rank_may_fail`
(distflow.distributed.agreement), which stops every rank with the failing rank's line: building the
batch, waiting for the rewards (the reward workers), and the step's report (rank 0's metric writes
and the observers). The other phases cannot be guarded so: generation and balancing, the logprob
pass, advantages, the update, the resync and the probe all hold collectives (FSDP's, vLLM's,
distflow's all_reduces), and a rank that failed inside one would skip a collective its peers
enter; the checkpoint save agrees after each of its own phases (distflow.checkpoint.checkpointer).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from distflow.checkpoint.checkpointer import POLICY, Checkpointer
from distflow.checkpoint.export import export_live
from distflow.config import DistflowConfig
from distflow.distributed import DistInfo, all_reduce, one_rank_may_fail, rank_and_world, shutdown, waited_s
from distflow.errors import RunAborted
from distflow.metrics.report import Reporter, StepRecord
from distflow.metrics.timer import PhaseTimer
from distflow.probe import EngineProbe
from distflow.rollout import Rollout, Validator
from distflow.rollout.schedule import bound_problem
from distflow.run.faults import FaultInjector
from distflow.run.preemption import StepBoundary, Stopped, StopSignal
from distflow.sample import training_rows
from distflow.startup import Run, start_run
from distflow.tasks import Task
from distflow.train.learner import Learner
from distflow.train.model_rewards import ModelRewards

log = logging.getLogger("distflow")


class Trainer:
    def __init__(self, cfg: DistflowConfig, observers: list | None = None, started: tuple[Run, StopSignal] | None = None):
        """`started`: the run and its stop signal when start_run ran already (distflow.job); else it runs here."""
        # From start_run on SIGTERM/SIGUSR1 only set a flag: the run saves and stops after its next step
        # (also when the signal comes during start-up, so a requeued job is requeued again).
        if started is None:
            stop_signal = StopSignal()
            started = start_run(cfg, stop_signal), stop_signal  # may stop here (a config error, a finished run)
        run, self.stop_signal = started
        self.run = run
        self.cfg = cfg = run.cfg
        self.dist, self.run_dir = run.dist, run.run_dir
        faults = [FaultInjector(cfg.run.fault_inject, self.dist.rank)] if cfg.run.fault_inject else []
        self.timer = PhaseTimer(self.dist.device, cfg.logging.sync_timing, [*(observers or []), *faults])
        with self.timer.phase("startup"):
            # a bad reward or task.env stops here, before any model loads; workers start while the models load
            self.task = Task.from_config(cfg.task, run.tokenizer, cfg.rollout.max_prompt_tokens,
                                         splits=("train", "heldout") if cfg.validation.wanted else ("train",))
            log.info(f"loading weights: {cfg.model.path} into the {cfg.rollout.engine} engine and the policy")
            self.rollout = self.build_rollout()
            self.learner = Learner(cfg, run.plan.layout, run.plan.model_path, run.plan.critic_path, run.pad_id,
                                   self.timer.phase, run.plan.teacher_path)
            # reward models and LLM judges: frozen models scoring each rank's samples, beside the reward functions
            self.model_rewards = ModelRewards(cfg, run.plan.layout, run.plan.scorer_paths, self.timer.phase) \
                if cfg.task.has_reward_models else None
            self.probe = self.build_probe()
            self.validator = Validator(cfg.validation, cfg.run.steps, self.evaluate)
            self.step, self.nonfinite_streak = 0, 0
            self.last_metrics: dict[str, float] = {}
            self.checkpointer = Checkpointer(self.run_dir.checkpoints, cfg.checkpoint.keep_last, self.dist.rank)
            self.checkpointer.before_marker = lambda step: self.timer.notify("before_checkpoint_marker", step)
            self.register_state()
            self.resume()
        self.reporter = Reporter(cfg, self.run_dir, self.dist.is_main, self.dist.world_size, run.record(),
                                 resumed_step=self.step)
        c = cfg.checkpoint
        self.boundary = StepBoundary(c.every, c.every_s, c.at_end)

    def build_rollout(self, dist: DistInfo | None = None) -> Rollout:
        """This rank's rollout; `dist`: the ranks its data and held-out items are sharded over (default: all)."""
        run = self.run
        return Rollout(self.cfg, dist or self.dist, self.task, run.tokenizer, run.plan.model_path,
                       run.plan.layout.engine_group, self.timer)

    def build_probe(self) -> EngineProbe:
        return EngineProbe(self.rollout, self.learner.policy, self.cfg.run, self.cfg.model.dtype, self.run.pad_id)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        start = time.perf_counter()
        self.run.note_expected_warnings()
        if self.stop_at_start():
            return
        self.probe.at_start(self.rollout.items)
        self.timer.notify("on_train_start", self.step)
        self.validator.before_training(self.step)
        while self.step < self.cfg.run.steps:
            self.step += 1
            metrics = self.train_step()
            metrics.update(self.validator.after_step(self.step))
            self.last_metrics = metrics
            with one_rank_may_fail(f"writing the report of step {self.step}"):
                self.reporter.log(self.step, metrics)
                self.timer.notify("on_step_end", self.step, metrics)
            self.check_finite_streak()
            if self.end_step():
                return
        self.finish(time.perf_counter() - start)

    def train_step(self) -> dict[str, float]:
        timing, phase = self.timer.new_step(self.step), self.timer.phase
        t0, waited0 = time.perf_counter(), waited_s()
        rollouts, pending = self.rollout.collect(self.step)
        self.check_staleness(rollouts.samples)
        self.rollout.sleep()
        with one_rank_may_fail(f"building the batch of step {self.step}"):
            batch = self.learner.batch(rollouts.samples, current_version=self.step - 1)
        with phase("logprob"):
            plan = self.learner.plan(batch)
            logprobs = self.learner.logprobs(plan)
        # what scoring did not hide behind the logprob pass
        with one_rank_may_fail(f"waiting for the rewards of step {self.step}"), phase("reward"):
            rewards = pending.result()
        rewards, model_sums = self.add_model_rewards(rollouts, rewards)
        batch = self.learner.advantages(batch, rewards, logprobs)
        batch = self.timer.passed("on_batch", self.step, batch)
        with phase("update"):
            result = self.learner.update(batch, plan, self.step)
        self.nonfinite_streak = self.nonfinite_streak + 1 if result.nonfinite_skipped else 0
        if result.nonfinite_skipped:
            log.warning(f"step {self.step}: a loss or gradient norm was not finite; the update was skipped")
        with phase("sync"):  # wakes the engine: weights, reload, KV cache
            self.sync_weights()
        with phase("probe"):
            probe = self.probe.after_sync(self.step, training_rows(rollouts.samples)[0], batch.tokens)
        timing["step"] = time.perf_counter() - t0
        timing["wait"] = waited_s() - waited0  # blocked in distflow's collectives, waiting for peers
        record = StepRecord(self.step, rollouts, rewards, result, timing, self.learner.policy.lr, probe, model_sums)
        return self.reporter.metrics(record)

    def add_model_rewards(self, rollouts, rewards):
        """The reward functions' rewards plus the reward models' and judges' weighted scores (their
        forwards are collectives, so they run here on every rank, not in the scoring thread), and
        this rank's sums of their raw scores for the metrics."""
        if self.model_rewards is None:
            return rewards, {}
        samples = rollouts.samples
        texts = [s.episode.final_text if s.episode is not None else
                 self.run.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scores, sums = self.model_rewards(rollouts.items, samples, texts, self.cfg.algorithm.group_size)
        return rewards + scores.view_as(rewards), sums

    def evaluate(self, tag: str) -> dict[str, float]:
        """One held-out evaluation (distflow.rollout.evaluation.Validator says when) on this rank's engine."""
        return self.rollout.evaluate(tag)

    # ----------------------------------------------------------------- weights
    def sync_weights(self) -> None:
        """The engine gets the policy: all weights (a LoRA policy's merged), or only the adapters."""
        if self.learner.sends_adapter:
            self.rollout.load_adapter(*self.learner.adapter(), version=self.step)
        else:
            weights = self.timer.passed("on_weights", self.step, self.learner.weights())
            self.rollout.load_weights(weights, version=self.step)

    # ----------------------------------------------------------------- step boundary
    def end_step(self) -> bool:
        """Checkpoint when due (interval, clock, end of run, signal); True when a signal stops the run."""
        save, halt = self.boundary.decide(self.step, self.step == self.cfg.run.steps, self.stop_signal)
        path = None
        if save:
            path = str(self.checkpointer.save(self.step, self.run.record(), self.run.plan.model_path))
            self.boundary.saved()
            self.timer.notify("on_checkpoint", self.step, path)
        if halt:
            self.boundary.stop(self.step, path, self.stop_signal, self.dist.is_main)
        return halt

    def stop_at_start(self) -> bool:
        """A signal during start-up stops before any step: nothing new to save since the checkpoint
        this launch resumed from (if any)."""
        if not self.boundary.signalled(self.stop_signal):
            return False
        self.boundary.stop(self.step, self.run.resume.checkpoint, self.stop_signal, self.dist.is_main)
        return True

    @property
    def stopped(self) -> Stopped | None:
        """Where a signal stopped the run (the recipe exits with EXIT_STOPPED); None: it did not."""
        return self.boundary.stopped if hasattr(self, "boundary") else None

    def check_staleness(self, samples) -> None:
        """The carry-over bound where it is trained: every token from a version >= step - 1 - eta
        (pipeline.max_staleness; 0 in sync mode). One all_reduce(min) over the ranks."""
        oldest = min((min(s.versions) for s in samples if s.versions), default=self.step - 1)
        if problem := bound_problem(self.step, int(all_reduce(float(oldest), op="min")), self.cfg.pipeline.max_staleness):
            raise RunAborted(problem)

    def check_finite_streak(self) -> None:
        """Stop after run.max_nonfinite_steps consecutive steps whose update was dropped."""
        if self.nonfinite_streak >= self.cfg.run.max_nonfinite_steps:
            raise RunAborted(f"step {self.step}: the loss or gradient norm was not finite for "
                             f"{self.nonfinite_streak} consecutive steps (run.max_nonfinite_steps); stopping")

    # ----------------------------------------------------------------- state
    def register_state(self) -> None:
        """Everything a resume restores, named once."""
        ck, policy, critic = self.checkpointer, self.learner.policy, self.learner.critic
        ck.register_model(POLICY, policy.model, policy.optimizer, policy.scheduler, trainable_only=policy.lora)
        if critic is not None:
            ck.register_model("critic", critic.model, critic.optimizer, critic.scheduler)
        for name, state in self.rollout.rank_state().items():  # the data cursor, groups carried or in flight
            ck.register(name, state, "rank")
        ck.register_rng(self.dist.device, self.cfg.run.seed)
        ck.register("trainer", self, "shared")

    def state_dict(self) -> dict:
        """The trainer's counters (the metric history stays in metrics.jsonl)."""
        return {"step": self.step, "evaluations": self.validator.evaluations, "nonfinite_streak": self.nonfinite_streak}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.nonfinite_streak = state["step"], state["nonfinite_streak"]
        self.validator.evaluations = state["evaluations"]

    def resume(self) -> None:
        """Restore everything the planned checkpoint holds, then give the engine the restored weights."""
        if (path := self.run.resume.checkpoint) is None:
            return
        self.checkpointer.load(Path(path))
        self.sync_weights()
        saved, now = self.run.resume.saved_world_size, rank_and_world()[1]  # (the trainers, in a split run)
        resized = f" written by {saved} rank(s), now {now}" if saved != now else ""
        log.info(f"resumed from step {self.step}{resized} ({path})")

    def finish(self, wall_s: float) -> None:
        """End of run: export, then summary.json and plots."""
        if self.cfg.checkpoint.export_at_end:  # a plain HF folder of the final policy (LoRA: merged, and the adapters)
            policy = self.learner.policy
            export_live(policy.model, self.run.plan.model_path, str(self.run_dir.hf_model), self.dist.is_main,
                        policy.adapter_config, str(self.run_dir.adapter))
        self.reporter.finish(self.step, wall_s, self.validator.evaluations, self.last_metrics)
        self.timer.notify("on_run_end", self)

    def close(self) -> None:
        self.stop_signal.uninstall()
        if hasattr(self, "reporter"):
            self.reporter.close()
        if hasattr(self, "rollout"):
            self.rollout.close()
        if hasattr(self, "task"):
            self.task.close()
        if self.dist.owns_group:
            shutdown()
        self.run_dir.unlock()  # the run is over: its folder is free (rank 0 held the lock)
