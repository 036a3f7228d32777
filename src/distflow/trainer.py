"""The RL loop, identical on every rank: rollout (generate -> balance -> score) -> logprobs ->
advantages -> update -> sync weights -> log -> checkpoint (or stop, on a signal).

There is no controller. Each rank samples its own prompts, generates all samples of a group
locally (so group statistics need no communication), and joins the others only through
FSDP's collectives and a few small all_reduces (global counts, batch statistics, metrics).
Ranks that share a tensor-parallel engine also all-gather their requests before each engine
call (distflow.rollout.engine_group); each still keeps only its own groups.
Multi-turn tasks (task.env) generate episodes instead of single responses (distflow.rollout.episodes);
everything after rollout is the same, with observation tokens masked out of the loss.
Algorithms differ only in the functions the config selects (distflow.algorithms.registry).
Each phase returns what it made (rollouts and their pending rewards, logprobs, advantages, the
update's record), and the step report turns those records into metrics (distflow.metrics.report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from distflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, dynamic_sampling_keep
from distflow.config import DistflowConfig, config_record
from distflow.tasks import ShardedSampler, load_prompts
from distflow.distributed import all_reduce, barrier, init_distributed, on_local_rank0_first, shutdown, waited_s
from distflow.distributed.devices import dtype_line, resolve_auto
from distflow.run.hostmem import limit_malloc_retention
from distflow.distributed.layout import ParallelLayout
from distflow.models import resolve_model_path
from distflow.tasks.rewards.pool import RewardPool
from distflow.rollout import build_engine
from distflow.rollout.balance import balance_groups
from distflow.rollout.episodes import EpisodeRunner, SingleTurn
from distflow.rollout.evaluation import evaluate
from distflow.rollout.groups import Rollouts, sample_seed
from distflow.rollout.scoring import score_groups
from distflow.probe import max_logprob_diff, mismatch_line
from distflow.train.weight_stream import full_parameters
from distflow.checkpoint.checkpointer import POLICY, Checkpointer, ModelOptimState, RNGState
from distflow.checkpoint.export import export_live
from distflow.run.faults import inject_fault, resync_fault, save_fault
from distflow.metrics.loggers import MetricLogger
from distflow.run.output import note_expected_warnings, save_config, setup_output
from distflow.errors import RunAborted
from distflow.run.preemption import StepBoundary, Stopped, StopSignal, write_stop_file
from distflow.metrics.report import StragglerWatch, run_summary, step_report
from distflow.metrics.timer import PhaseTimer
from distflow.run.resume import agree_on_plan
from distflow.run.rundir import RunDir
from distflow.sample import Sample
from distflow.train.batch import CURRENT_POLICY, OldLogprobs, TokenBatch, UpdateBatch
from distflow.train.critic import Critic
from distflow.train.lora import adapter_tensors
from distflow.train.memory_budget import check_memory_budget
from distflow.train.policy import Policy, check_model_options
from distflow.train.shaping import shape_rewards
from distflow.train.update import StepPlan, Updater, UpdateResult

log = logging.getLogger("distflow")


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """The forward passes before the update: old (sampling-time) and reference logprobs, values."""

    old: OldLogprobs
    ref: torch.Tensor | None
    values: torch.Tensor | None


class Trainer:
    def __init__(self, cfg: DistflowConfig):
        self.cfg = cfg.validate()
        r, a = cfg.run, cfg.algorithm
        limit_malloc_retention(r.host_mmap_threshold_kib)  # before any model or engine allocates
        # Order matters: process group, then engine (reuses it), then the FSDP models.
        self.dist = init_distributed(r.backend, r.device, r.collective_timeout_s)
        dtype_note = dtype_line(cfg.model.dtype, self.dist.device)
        self.cfg = cfg = resolve_auto(cfg, self.dist.device)  # dtype, eager mode, shard degree for the device
        self.run_dir = RunDir(r.output_dir)
        self.plan = agree_on_plan(cfg, self.dist)  # before anything is written or loaded: may stop here
        # From here on SIGTERM/SIGUSR1 only set a flag: the run saves and stops after its next step
        # (also when the signal comes during start-up, so a requeued job is requeued again).
        self.stop_signal = StopSignal().install()
        self.stopped: Stopped | None = None
        setup_output(self.run_dir.rank_log(self.dist.rank), self.dist.rank, cfg.logging.level)
        for note in self.plan.warnings:
            log.warning(note)
        log.info(f"{self.dist.world_size} rank(s) on {self.dist.device.type} ({self.dist.backend}), {dtype_note}")
        self.layout = ParallelLayout.from_config(cfg.model, self.dist, cfg.rollout.tensor_parallel_size)
        save_config(cfg, self.run_dir.config, write=self.dist.is_main)
        random.seed(r.seed)
        np.random.seed(r.seed)
        torch.manual_seed(r.seed)
        self.model_path = on_local_rank0_first(lambda: resolve_model_path(cfg.model.path), self.dist.local_rank)
        self.tokenizer = tok = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.updater = Updater(cfg, self.pad_id)  # plans each batch's passes once, runs them
        # a bad reward or task.env stops here, before any model loads; workers start while the models load
        self.rewards = RewardPool.from_task(cfg.task)
        env = self.rewards.env  # the task's environment (None: single turn); its reset builds the prompts
        self.scoring_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distflow-scoring")
        limit = cfg.rollout.max_prompt_tokens
        self.items = load_prompts(cfg.task, tok, limit, env=env)
        self.heldout = load_prompts(cfg.task, tok, limit, split="heldout", env=env) if cfg.validation.wanted else []
        self.sampler = ShardedSampler(len(self.items), self.dist.rank, self.dist.world_size, r.seed, cfg.data.shuffle)
        critic_path = on_local_rank0_first(lambda: resolve_model_path(cfg.critic.path), self.dist.local_rank) \
            if cfg.critic.path else self.model_path
        check_model_options(self.model_path, cfg.model)  # before any weights load
        check_memory_budget(cfg, self.model_path, self.layout, critic_path)  # CUDA: what each phase needs must fit
        self.timer = PhaseTimer(self.dist.device, cfg.logging.sync_timing)
        log.info(f"loading weights: {cfg.model.path} into the {cfg.rollout.engine} engine and the policy")
        self.engine = build_engine(self.model_path, cfg.model, cfg.rollout, self.dist.device, r.seed,
                                   self.layout.engine_group)
        # single-turn generation, or multi-turn episodes with the task's environment
        self.runner = EpisodeRunner(self.engine, self.rewards, tok, cfg.rollout,
                                    lockstep=cfg.rollout.tensor_parallel_size > 1) if env else SingleTurn(self.engine)
        self.policy = Policy(self.model_path, cfg.model, cfg.optim, self.layout)
        # The frozen reference exists only when KL is on: beta = 0 costs nothing. With LoRA it is
        # the policy with its adapters off.
        self.reference = None if a.kl_coef <= 0 else self.policy.base() if self.policy.lora \
            else Policy(self.model_path, cfg.model, cfg.optim, self.layout, trainable=False)
        # The critic exists only for estimators that need values (PPO's GAE).
        self.critic = Critic(critic_path, cfg.critic, cfg.model, cfg.optim, self.layout) if cfg.has_critic else None
        self.estimator = ADVANTAGE_ESTIMATORS[a.advantage]
        self.step, self.evaluations, self.nonfinite_streak = 0, {}, 0
        self.last_metrics: dict[str, float] = {}
        self.checkpointer = Checkpointer(self.run_dir.checkpoints, cfg.checkpoint.keep_last, self.dist.rank)
        self.checkpointer.before_marker = save_fault(r.fault_inject, self.dist.rank)
        self.register_state()
        self.resume()
        self.logger = MetricLogger(self.run_dir, self.dist.is_main, r.steps, cfg.logging, config_record(cfg),
                                   resumed_step=self.step)
        c = cfg.checkpoint
        self.boundary = StepBoundary(c.every, c.every_s, c.at_end)
        self.stragglers = StragglerWatch(cfg.logging.straggler_warn_steps)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        steps, v = self.cfg.run.steps, self.cfg.validation
        start = time.perf_counter()
        note_expected_warnings(self.run_dir.rank_log(self.dist.rank))
        if self.stop_at_start():
            return
        self.check_engine_at_start()
        if v.before_train and self.step == 0:
            self.evaluations["before"] = self.validate()
        while self.step < steps:
            self.step += 1
            metrics = self.train_step()
            if v.every and self.step % v.every == 0 and self.step != steps:
                metrics.update(self.validate())
            if self.step == steps and v.at_end:
                self.evaluations["after"] = self.validate()
                metrics.update(self.evaluations["after"])
            self.last_metrics = metrics
            self.logger.log(metrics)
            if note := self.stragglers.observe(metrics):
                log.warning(f"step {self.step}: {note}")
            self.check_finite_streak()
            if self.end_step():
                return
        self.finish(time.perf_counter() - start)

    def train_step(self) -> dict[str, float]:
        timing = self.timer.new_step(self.step)
        t0, waited0 = time.perf_counter(), waited_s()
        rollouts, pending = self.rollout()
        self.engine.sleep()
        batch = UpdateBatch.from_samples(rollouts.samples, self.pad_id, self.layout.device,
                                         self.cfg.algorithm.overlong_filter)
        with self.timer.phase("logprob"):
            plan = self.updater.plan(batch.tokens)
            logprobs = self.compute_logprobs(plan)
        with self.timer.phase("reward"):  # what scoring did not hide behind the logprob pass
            rewards = pending.result()
        batch = self.compute_advantages(batch, rewards, logprobs)
        batch = inject_fault(self.cfg.run.fault_inject, self.dist.rank, self.step, batch)
        with self.timer.phase("update"):
            result = self.update(batch, plan)
        self.nonfinite_streak = self.nonfinite_streak + 1 if result.nonfinite_skipped else 0
        if result.nonfinite_skipped:
            log.warning(f"step {self.step}: a loss or gradient norm was not finite; the update was skipped")
        with self.timer.phase("sync"):  # wakes the engine: weights, reload, KV cache
            self.sync_weights()
        with self.timer.phase("probe"):
            probe = self.probe_sync(rollouts.samples, batch.tokens)
        timing["step"] = time.perf_counter() - t0
        timing["wait"] = waited_s() - waited0  # blocked in distflow's collectives, waiting for peers
        return step_report(self.cfg, self.step, rollouts.samples, rewards, len(rollouts.items), rollouts.stats,
                           result, timing, probe, self.policy.lr)

    # ----------------------------------------------------------------- phases
    def rollout(self) -> tuple[Rollouts, Future]:
        """Generate groups, balance them across ranks, and start scoring; returns the rollouts and
        the pending rewards ([groups, G]). With dynamic sampling (DAPO) groups are scored at once,
        those whose rewards are all equal are dropped, and every rank keeps generating until the
        GLOBAL number of kept groups reaches the target or the round limit is hit."""
        a, per_rank = self.cfg.algorithm, self.cfg.data.prompts_per_rank
        kept = Rollouts(a.group_size)
        for _ in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            with self.timer.phase("generate"):
                part = self.generate(per_rank)
            kept.stats.rounds += 1
            kept.stats.generated_groups += len(part.items)
            if not a.dynamic_sampling:
                kept = dataclasses.replace(part, stats=kept.stats)
                break
            with self.timer.phase("reward"):
                part.rewards = self.score(part)
            kept.keep_groups(part, dynamic_sampling_keep(part.rewards))
            if int(all_reduce(len(kept.items))) >= per_rank * self.dist.world_size:
                break
        if a.dynamic_sampling and kept.rewards is None:
            kept.rewards = torch.zeros((0, a.group_size))
        if self.cfg.run.balance_lengths:  # the update waits for the rank with the most tokens
            with self.timer.phase("balance"):
                moved, kept.stats.balance = balance_groups(kept.groups(), kept.token_costs(), self.dist.device)
                kept.set_groups(moved)
        pending: Future = Future()
        if kept.rewards is not None:
            pending.set_result(kept.rewards)
        else:  # scored in the reward pool's processes while this one computes logprobs
            pending = self.scoring_thread.submit(self.score, kept)
        return kept, pending

    def generate(self, n_prompts: int) -> Rollouts:
        idx = self.sampler.next_indices(n_prompts)
        items = [self.items[i] for i in idx]
        # the sampler's position makes seeds unique across rounds and steps
        pos = self.sampler.state_dict()
        seeds = [sample_seed(self.cfg.run.seed, pos["epoch"], pos["offset"], self.dist.rank, i) for i in idx]
        log.debug(f"step {self.step} items (epoch, index): {json.dumps(self.sampler.last_positions)}")
        groups = self.runner.run(items, self.cfg.algorithm.group_size, seeds)
        return Rollouts(self.cfg.algorithm.group_size, items, [s for g in groups for s in g])

    def score(self, rollouts: Rollouts) -> torch.Tensor:
        rewards, failures = score_groups(self.rewards, self.tokenizer, rollouts.items, rollouts.samples,
                                         self.cfg.algorithm.group_size)
        rollouts.stats.add_failures(failures)
        return rewards

    def compute_logprobs(self, plan: StepPlan) -> Logprobs:
        a, o, u = self.cfg.algorithm, self.cfg.optim, self.updater
        # With one optimizer step per rollout the policy that sampled is the one being trained.
        needs_old = a.ppo_epochs > 1 or o.mini_batches > 1 or (a.kl_coef > 0 and a.kl_in_reward)
        old = u.logprobs(self.policy, plan) if needs_old else CURRENT_POLICY
        ref = u.logprobs(self.reference, plan) if self.reference else None
        values = u.values(self.critic, plan) if self.critic else None
        return Logprobs(old, ref, values)

    def compute_advantages(self, batch: UpdateBatch, rewards: torch.Tensor, lp: Logprobs) -> UpdateBatch:
        old = lp.old if lp.old is not CURRENT_POLICY else None
        scores, token_rewards = shape_rewards(rewards, batch.tokens, self.cfg.algorithm,
                                              self.cfg.rollout.response_budget(), old, lp.ref)
        inputs = AdvantageInputs(scores, token_rewards, batch.tokens.resp_mask, lp.values)  # all on the device
        advantages, returns = self.estimator(inputs, self.cfg.algorithm, lambda v: all_reduce(v).tolist())
        return batch.with_(advantages=advantages, old_logprobs=lp.old, ref_logprobs=lp.ref, values=lp.values,
                           returns=returns)

    def update(self, batch: UpdateBatch, plan: StepPlan) -> UpdateResult:
        """The optimizer steps over `plan`; none if no group is left anywhere, the critic's alone in its warm-up."""
        if int(all_reduce(len(batch))) == 0:
            log.info(f"step {self.step}: every group was filtered out; update skipped")
            return UpdateResult(skipped=True)
        train_actor = self.critic is None or self.step > self.cfg.critic.warmup_steps
        return self.updater.optimize(self.policy if train_actor else None, self.critic, batch, plan)

    def end_step(self) -> bool:
        """Checkpoint when due (interval, clock, end of run, signal); True when a signal stops the run."""
        save, halt = self.boundary.decide(self.step, self.step == self.cfg.run.steps, self.stop_signal)
        path = None
        if save:
            path = str(self.checkpointer.save(self.step, config_record(self.cfg), self.model_path))
            self.boundary.saved()
        if halt:
            self.report_stop(path)
        return halt

    def stop_at_start(self) -> bool:
        """A signal during start-up stops before any step: nothing new to save since the checkpoint
        this launch resumed from (if any)."""
        if not self.boundary.signalled(self.stop_signal):
            return False
        self.report_stop(self.plan.checkpoint)
        return True

    def report_stop(self, checkpoint: str | None) -> None:
        self.stopped = Stopped(self.step, checkpoint, self.stop_signal.name or "a signal to another rank")
        where = f"with checkpoint {checkpoint}" if checkpoint else "with no checkpoint (nothing trained yet)"
        log.warning(f"{self.stopped.signal}: stopped after step {self.step} {where}; "
                    "relaunch with the same run.output_dir to resume")
        if self.dist.is_main:
            write_stop_file(self.stopped)
        barrier()  # no rank exits before the launcher can read where the run stopped

    def check_finite_streak(self) -> None:
        """Stop after run.max_nonfinite_steps consecutive steps whose update was dropped."""
        if self.nonfinite_streak >= self.cfg.run.max_nonfinite_steps:
            raise RunAborted(f"step {self.step}: the loss or gradient norm was not finite for "
                             f"{self.nonfinite_streak} consecutive steps (run.max_nonfinite_steps); stopping")

    def sync_weights(self) -> None:
        """The engine gets the policy: all weights (a LoRA policy's merged), or only the adapters."""
        if self.policy.lora and self.cfg.model.lora.resync == "adapter":
            self.engine.load_adapter(adapter_tensors(self.policy.model), self.policy.adapter_config)
            return
        bucket = self.cfg.rollout.sync_bucket_mib << 20
        weights = full_parameters(self.policy.model, getattr(torch, self.cfg.model.dtype), bucket)
        self.engine.load_weights(resync_fault(self.cfg.run.fault_inject, self.dist.rank, self.step, weights))

    def probe_sync(self, samples: list[Sample], tokens: TokenBatch) -> float:
        """Max |engine - policy| logprob on this step's first sequences (the batch's own rows), after the
        resync (NaN when not probed)."""
        n, every = self.cfg.run.sync_probe_seqs, self.cfg.run.sync_probe_every
        if n == 0 or (self.step % every and self.step != 1):
            return float("nan")
        seqs = [s.prompt_ids + s.response_ids for s in samples[:n]]
        rows = tokens.whole(list(range(len(seqs)))) if seqs else None
        return self.check_engine(seqs or [[self.pad_id, self.pad_id]], f"step {self.step}", rows)

    def check_engine_at_start(self) -> None:
        """Once before any step, whatever run.sync_probe_every says: the engine as loaded (or resynced from
        the checkpoint) against the policy, on this rank's first prompts; a mismatched family stops here."""
        n = max(self.cfg.run.sync_probe_seqs, 2)
        seqs = [item.prompt_ids for item in self.items[:n]] or [[self.pad_id, self.pad_id]]
        diff = self.check_engine(seqs, "start-up")
        log.info(f"start-up probe: engine and policy logprobs agree to {diff:.3g}")

    def check_engine(self, seqs: list[list[int]], when: str, rows: TokenBatch | None = None) -> float:
        """The largest |engine - policy| logprob of any rank on `seqs`; past PROBE_LIMIT every rank stops
        with the same line (run.allow_engine_mismatch: warns)."""
        diff = max_logprob_diff(self.engine, self.policy, seqs, self.pad_id, rows)
        diff = float(all_reduce(diff, op="max")[0])
        line = mismatch_line(diff, self.cfg.model.dtype, self.policy.model.config.model_type, when)
        if line and not self.cfg.run.allow_engine_mismatch:
            raise RunAborted(line)
        if line:
            log.warning(line)
        return diff

    def validate(self) -> dict[str, float]:
        return evaluate(self.runner, self.rewards, self.tokenizer, self.heldout, self.dist, self.cfg.validation.pass_k,
                        seed=self.cfg.run.seed)

    # ----------------------------------------------------------------- state
    def register_state(self) -> None:
        """Everything a resume restores, named once."""
        ck = self.checkpointer
        # a LoRA policy's checkpoint is its adapters and their optimizer: model.path holds the base
        ck.register(POLICY, ModelOptimState(self.policy.model, self.policy.optimizer, trainable_only=self.policy.lora),
                    "sharded")
        ck.register("policy_schedule", self.policy.scheduler, "shared")
        if self.critic is not None:
            ck.register("critic", ModelOptimState(self.critic.model, self.critic.optimizer), "sharded")
            ck.register("critic_schedule", self.critic.scheduler, "shared")
        ck.register("sampler", self.sampler, "rank")
        ck.register("rng", RNGState(self.dist.device, self.cfg.run.seed), "rank")
        ck.register("trainer", self, "shared")

    def state_dict(self) -> dict:
        """The trainer's counters (the metric history stays in metrics.jsonl)."""
        return {"step": self.step, "evaluations": self.evaluations, "nonfinite_streak": self.nonfinite_streak}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evaluations, self.nonfinite_streak = state["step"], state["evaluations"], state["nonfinite_streak"]

    def resume(self) -> None:
        """Restore everything the planned checkpoint holds, then give the engine the restored weights."""
        if (path := self.plan.checkpoint) is None:
            return
        self.checkpointer.load(Path(path))
        self.sync_weights()
        saved, now = self.plan.saved_world_size, self.dist.world_size
        resized = f" written by {saved} rank(s), now {now}" if saved != now else ""
        log.info(f"resumed from step {self.step}{resized} ({path})")

    def finish(self, wall_s: float) -> None:
        """End of run: export, then summary.json and plots."""
        if self.cfg.checkpoint.export_at_end:  # a plain HF folder of the final policy (LoRA: merged, and the adapters)
            export_live(self.policy.model, self.model_path, str(self.run_dir.hf_model), self.dist.is_main,
                        self.policy.adapter_config, str(self.run_dir.adapter))
        summary = run_summary(self.step, wall_s, self.dist.world_size, self.evaluations, self.last_metrics)
        self.logger.finish(summary, plots=self.cfg.logging.plot_at_end)

    def close(self) -> None:
        if hasattr(self, "stop_signal"):
            self.stop_signal.uninstall()
        if hasattr(self, "logger"):
            self.logger.close()
        self.scoring_thread.shutdown(wait=True)
        self.rewards.close()
        self.engine.shutdown()
        if self.dist.owns_group:
            shutdown()
        self.run_dir.unlock()  # the run is over: its folder is free (rank 0 held the lock)
