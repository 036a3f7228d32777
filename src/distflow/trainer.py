"""The RL loop, identical on every rank: generate -> score -> logprobs -> advantages -> update
-> sync weights -> log -> checkpoint.

There is no controller. Each rank samples its own prompts, generates all samples of a group
locally (so group statistics need no communication), and joins the others only through
FSDP's collectives and a few small all_reduces (global counts, batch statistics, metrics).
Algorithms differ only in the functions the config selects (distflow.algorithms.registry).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoTokenizer

from distflow.algorithms import (ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS, dynamic_sampling_keep, overlong_penalty,
                                  token_kl)
from distflow.balance import balance_groups
from distflow.checkpoint import Checkpointer, ModelOptimState, resolve_resume, rng_state, set_rng_state
from distflow.config import ConfigError, DistflowConfig
from distflow.data.prompts import PromptItem, load_prompts
from distflow.data.sampler import ShardedSampler
from distflow.distributed import all_reduce, barrier, broadcast_object, init_distributed, shutdown
from distflow.evaluation import evaluate
from distflow.metrics import MetricLogger, reduce_step_metrics
from distflow.models.tiny import resolve_model_path
from distflow.policy import Policy, TokenBatch
from distflow.rewards.pool import RewardPool
from distflow.rollout import Sample, build_engine
from distflow.rollout.weight_sync import full_parameters
from distflow.scoring import REWARD_FAILURES, score_groups
from distflow.critic import Critic
from distflow.update import backward_policy_loss, backward_value_loss, pad_rows, per_sample_logprobs, per_sample_rows

log = logging.getLogger("distflow")


@dataclass
class Rollouts:
    """A rank's batch: samples in group-major order (group_size consecutive per prompt)."""

    items: list[PromptItem] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # [num_prompts, group_size]
    advantages: torch.Tensor | None = None  # [num_samples], or [num_samples, T] per token (GAE)
    old_logprobs: list[torch.Tensor] | None = None  # per sample, when the update needs them
    ref_logprobs: list[torch.Tensor] | None = None  # per sample, when KL is on
    values: list[torch.Tensor] | None = None  # per sample, the critic's (PPO)
    returns: list[torch.Tensor] | None = None  # per sample, the critic's targets (PPO)
    reward_stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REWARD_FAILURES, 0.0))
    rounds: int = 0
    generated_groups: int = 0
    scoring: Future | None = None  # rewards still being scored in the background
    balance_stats: dict[str, float] = field(default_factory=dict)

    def groups(self, group_size: int) -> list[tuple]:
        """(item, its samples, its rewards row or None) per prompt: the unit that moves between ranks."""
        return [(item, self.samples[g * group_size : (g + 1) * group_size],
                 self.rewards[g] if self.rewards is not None else None) for g, item in enumerate(self.items)]

    def set_groups(self, groups: list[tuple], group_size: int) -> None:
        self.items = [item for item, _, _ in groups]
        self.samples = [s for _, samples, _ in groups for s in samples]
        if self.rewards is not None:
            self.rewards = torch.stack([r for _, _, r in groups]) if groups else torch.zeros((0, group_size))

    def keep_groups(self, other: "Rollouts", keep: torch.Tensor, group_size: int) -> None:
        """Append the groups of `other` selected by the boolean mask `keep`."""
        for g in keep.nonzero().flatten().tolist():
            self.items.append(other.items[g])
            self.samples += other.samples[g * group_size : (g + 1) * group_size]
        chosen = other.rewards[keep]
        self.rewards = chosen if self.rewards is None else torch.cat([self.rewards, chosen])


def sample_seed(*parts: int) -> int:
    """A 31-bit seed derived from (run seed, step, rank, index): reproducible and resumable."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Trainer:
    def __init__(self, cfg: DistflowConfig):
        self.cfg = cfg.validate()
        t, a = cfg.trainer, cfg.algorithm
        # Order matters: process group, then engine (reuses it), then the FSDP policy.
        self.dist = init_distributed(t.backend, t.device, t.collective_timeout_s)
        if cfg.model.shard_ranks > 0 and self.dist.world_size % cfg.model.shard_ranks:
            raise ConfigError(f"model.shard_ranks={cfg.model.shard_ranks} does not divide the world size "
                              f"{self.dist.world_size}")
        check_same_config(cfg, t.output_dir, self.dist.is_main)
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        self.model_path = resolve_on_local_rank0_first(cfg.model.path, self.dist.local_rank)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.rewards = RewardPool.from_task(cfg.task)  # workers start while the models load
        self.scoring_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distflow-scoring")
        limit = cfg.rollout.max_prompt_tokens
        self.items = load_prompts(cfg.task, self.tokenizer, limit)
        self.heldout = load_prompts(cfg.task, self.tokenizer, limit, split="heldout") if self._wants_validation() else []
        self.sampler = ShardedSampler(len(self.items), self.dist.rank, self.dist.world_size, t.seed, cfg.data.shuffle)
        self.engine = build_engine(self.model_path, cfg.model, cfg.rollout, self.dist.device, t.seed)
        self.policy = Policy(self.model_path, cfg.model, cfg.optim, self.dist.device, self.dist.world_size)
        # The frozen reference exists only when KL is on: beta = 0 costs nothing.
        self.reference = (Policy(self.model_path, cfg.model, cfg.optim, self.dist.device, self.dist.world_size,
                                 trainable=False) if a.kl_coef > 0 else None)
        # The critic exists only for estimators that need values (PPO's GAE).
        self.critic = (Critic(resolve_on_local_rank0_first(cfg.critic.path, self.dist.local_rank) if cfg.critic.path
                              else self.model_path, cfg.critic, cfg.model, cfg.optim, self.dist.device,
                              self.dist.world_size) if cfg.critic.enabled else None)
        self.engine_dtype = getattr(torch, cfg.model.dtype)
        self.advantage_fn = ADVANTAGE_ESTIMATORS.get(a.advantage) or CRITIC_ESTIMATORS[a.advantage]
        self.checkpointer = Checkpointer(t.output_dir, t.keep_last, self.dist.rank)
        self.step = 0
        self.history: list[dict] = []  # every logged step, kept so a resume can rewrite metrics.jsonl
        self.summary: dict = {}
        self.resume()
        self.logger = MetricLogger(t.output_dir, self.dist.is_main, t.steps, t.progress_bar,
                                   loggers=t.loggers, run_config=cfg, project=t.wandb_project)

    def _wants_validation(self) -> bool:
        t = self.cfg.trainer
        return bool(t.val_every or t.val_before_train or t.val_at_end)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        t = self.cfg.trainer
        start = time.perf_counter()
        if t.val_before_train and self.step == 0:
            self.summary["before"] = self.validate()
        while self.step < t.steps:
            self.step += 1
            timing: dict[str, float] = {}
            t0 = time.perf_counter()
            batch = self.collect_rollouts(timing)
            inject_fault(t.fault_inject, self.dist.rank, self.step)
            self.engine.sleep()
            with _timed(timing, "logprob"):
                self.compute_logprobs(batch)
            with _timed(timing, "reward"):
                self.finish_scoring(batch)
            self.compute_advantages(batch)
            with _timed(timing, "update"):
                update_stats = self.update(batch)
            self.engine.wake_up()
            with _timed(timing, "sync"):
                self.sync_weights()
            with _timed(timing, "probe"):
                probe_diff = self.probe_sync(batch)
            timing["step"] = time.perf_counter() - t0
            metrics = self.step_metrics(batch, timing, update_stats, probe_diff)
            if t.val_every and self.step % t.val_every == 0 and self.step != t.steps:
                metrics.update(self.validate())
            if self.step == t.steps and t.val_at_end:
                self.summary["after"] = self.validate()
                metrics.update(self.summary["after"])
            self.history.append(metrics)
            self.logger.log(metrics)
            if self.step == t.steps or (t.checkpoint_every and self.step % t.checkpoint_every == 0):
                self.save_checkpoint()
        self.finish(time.perf_counter() - start)

    # ----------------------------------------------------------------- phases
    def collect_rollouts(self, timing: dict[str, float]) -> Rollouts:
        """Generate and score groups. With dynamic sampling (DAPO), groups whose rewards are all
        equal carry no signal and are dropped, and every rank keeps generating until the GLOBAL
        number of kept groups reaches the target or the round limit is hit."""
        a, per_rank = self.cfg.algorithm, self.cfg.data.prompts_per_rank
        target = per_rank * self.dist.world_size
        if not a.dynamic_sampling:
            with _timed(timing, "generate"):
                batch = self.generate(per_rank)
            self.balance(batch, timing)
            # scored in the reward pool's processes while this one computes logprobs
            batch.scoring = self.scoring_thread.submit(self.score, batch)
            batch.rounds, batch.generated_groups = 1, len(batch.items)
            return batch
        kept = Rollouts()
        for _ in range(a.max_sampling_rounds):
            with _timed(timing, "generate"):
                part = self.generate(per_rank)
            with _timed(timing, "reward"):
                self.score(part)
            for k in REWARD_FAILURES:
                kept.reward_stats[k] += part.reward_stats[k]
            kept.rounds += 1
            kept.generated_groups += len(part.items)
            kept.keep_groups(part, dynamic_sampling_keep(part.rewards), a.group_size)
            if int(all_reduce(len(kept.items))) >= target:
                break
        if kept.rewards is None:
            kept.rewards = torch.zeros((0, a.group_size))
        self.balance(kept, timing)
        return kept

    def balance(self, batch: Rollouts, timing: dict[str, float]) -> None:
        """trainer.balance_lengths: move whole groups between ranks so each holds about as many
        tokens (prompt + response), since the update waits for the rank with the most."""
        if not self.cfg.trainer.balance_lengths:
            return
        with _timed(timing, "balance"):
            groups = batch.groups(self.cfg.algorithm.group_size)
            costs = [sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) for _, samples, _ in groups]
            moved, batch.balance_stats = balance_groups(groups, costs, self.dist.device)
            batch.set_groups(moved, self.cfg.algorithm.group_size)

    def generate(self, n_prompts: int) -> Rollouts:
        idx = self.sampler.next_indices(n_prompts)
        items = [self.items[i] for i in idx]
        # the sampler's position makes seeds unique across rounds and steps
        pos = self.sampler.state_dict()
        seeds = [sample_seed(self.cfg.trainer.seed, pos["epoch"], pos["offset"], self.dist.rank, i) for i in idx]
        groups = self.engine.generate([it.prompt_ids for it in items], self.cfg.algorithm.group_size, seeds)
        return Rollouts(items, [s for g in groups for s in g])

    def finish_scoring(self, batch: Rollouts) -> None:
        if batch.scoring is not None:
            batch.scoring.result()
            batch.scoring = None

    def score(self, batch: Rollouts) -> None:
        batch.rewards, batch.reward_stats = score_groups(
            self.rewards, self.tokenizer, batch.items, batch.samples, self.cfg.algorithm.group_size)

    def _needs_old_logprobs(self) -> bool:
        # With one optimizer step per rollout the policy that sampled is the one being trained,
        # so the ratio is 1 by construction and old logprobs are the detached current ones.
        a = self.cfg.algorithm
        return a.ppo_epochs > 1 or self.cfg.optim.mini_batches > 1 or (a.kl_coef > 0 and a.kl_in_reward)

    def compute_logprobs(self, batch: Rollouts) -> None:
        if self._needs_old_logprobs():
            batch.old_logprobs = per_sample_logprobs(self.policy, batch.samples, self.cfg, self.pad_id)
        if self.reference is not None:
            batch.ref_logprobs = per_sample_logprobs(self.reference, batch.samples, self.cfg, self.pad_id)
        if self.critic is not None:
            batch.values = per_sample_rows(self.critic.values, batch.samples, self.cfg, self.pad_id, self.critic.device)

    def compute_advantages(self, batch: Rollouts) -> None:
        a, r = self.cfg.algorithm, self.cfg.rollout
        global_sum = lambda v: all_reduce(v).tolist()  # noqa: E731
        rewards = batch.rewards.clone()
        if a.overlong_buffer_len > 0:  # DAPO soft overlong punishment
            lens = torch.tensor([len(s.response_ids) for s in batch.samples], dtype=torch.float32)
            rewards += overlong_penalty(lens, r.max_new_tokens, a.overlong_buffer_len, a.overlong_penalty).view_as(rewards)
        width = max([1] + [len(s.response_ids) for s in batch.samples])
        mask = pad_rows([torch.ones(len(s.response_ids)) for s in batch.samples], width)
        kl = None
        if a.kl_coef > 0 and a.kl_in_reward and batch.samples:
            old, ref = pad_rows(batch.old_logprobs, width).cpu(), pad_rows(batch.ref_logprobs, width).cpu()
            kl = a.kl_coef * token_kl(old, ref, mask, a.kl_estimator)
        if self.critic is None:
            if kl is not None:
                rewards -= kl.sum(-1).view_as(rewards)
            batch.advantages = self.advantage_fn(rewards, a, global_sum).reshape(-1)
            return
        adv, returns = self.advantage_fn(rewards.reshape(-1), pad_rows(batch.values, width).cpu(), mask, a,
                                         global_sum, token_penalty=kl)
        batch.advantages = adv
        batch.returns = [returns[i, : len(s.response_ids)] for i, s in enumerate(batch.samples)]

    def update(self, batch: Rollouts) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps of the policy (and the critic, when there is
        one); skipped on all ranks if no group is left. During critic warm-up only the critic trains."""
        o = self.cfg.optim
        if int(all_reduce(len(batch.samples))) == 0:
            log_main(self.dist.is_main, f"step {self.step}: every group was filtered out; update skipped")
            return {"skipped": 1.0}
        train_actor = self.critic is None or self.step > self.cfg.critic.warmup_steps
        per_mini = -(-len(batch.samples) // o.mini_batches) if batch.samples else 0
        totals: dict[str, float] = {"skipped": 0.0, "actor_skipped": float(not train_actor)}
        grad_norms, critic_norms = [], []

        def rows_of(per_sample, rows):
            return per_sample[rows] if per_sample is not None else None

        for _ in range(self.cfg.algorithm.ppo_epochs):
            for m in range(o.mini_batches):
                rows = slice(m * per_mini, (m + 1) * per_mini)
                stats = {}
                if train_actor:
                    stats = backward_policy_loss(
                        self.policy, batch.samples[rows], batch.advantages[rows], rows_of(batch.old_logprobs, rows),
                        self.cfg, self.pad_id, ref_logprobs=rows_of(batch.ref_logprobs, rows))
                    grad_norms.append(self.policy.step())
                if self.critic is not None:
                    stats.update(backward_value_loss(self.critic, batch.samples[rows], batch.values[rows],
                                                     batch.returns[rows], self.cfg, self.pad_id))
                    critic_norms.append(self.critic.step())
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        passes = o.mini_batches * self.cfg.algorithm.ppo_epochs
        for key in ("loss", "value_loss"):
            totals[key] = totals.get(key, 0.0) / passes
        totals["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        totals["critic_grad_norm"] = sum(critic_norms) / max(len(critic_norms), 1)
        return totals

    def sync_weights(self) -> None:
        bucket = self.cfg.rollout.sync_bucket_mib << 20
        self.engine.load_weights(full_parameters(self.policy.model, self.engine_dtype, bucket))

    @torch.no_grad()
    def probe_sync(self, batch: Rollouts) -> float:
        """Max |engine - policy| logprob on this step's sequences, after the resync."""
        n, every = self.cfg.trainer.sync_probe_seqs, self.cfg.trainer.sync_probe_every
        if n == 0 or (self.step % every and self.step != 1):
            return float("nan")
        samples = batch.samples[:n] or [Sample([self.pad_id], [self.pad_id], [], False)]
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        engine_lp = self.engine.prompt_logprobs(seqs)
        as_samples = [Sample(seq[:1], seq[1:], [], False) for seq in seqs]
        policy_lp = self.policy.logprobs(TokenBatch.from_samples(as_samples, self.pad_id, self.dist.device), 1.0)
        diff = 0.0
        for i, lp in enumerate(engine_lp):
            ref = policy_lp[i, : len(lp)].float().cpu()
            diff = max(diff, float((torch.tensor(lp) - ref).abs().max()))
        return diff

    def validate(self) -> dict[str, float]:
        k = self.cfg.trainer.val_pass_k
        return evaluate(self.engine, self.rewards, self.tokenizer, self.heldout, self.dist, k,
                        seed=self.cfg.trainer.seed)

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        rank_state = {"rng": rng_state(), "sampler": self.sampler.state_dict()}
        shared = {"history": self.history, "scheduler": self.policy.scheduler.state_dict(),
                  "model_path": self.model_path, "world_size": self.dist.world_size, "summary": self.summary}
        if self.critic is not None:
            shared["critic_scheduler"] = self.critic.scheduler.state_dict()
        self.checkpointer.save(self.step, self.stateful_models(), rank_state, shared)

    def stateful_models(self) -> dict[str, ModelOptimState]:
        """What DCP saves: the policy ("app", its key since the first format) and the critic."""
        states = {"app": ModelOptimState(self.policy.model, self.policy.optimizer)}
        if self.critic is not None:
            states["critic"] = ModelOptimState(self.critic.model, self.critic.optimizer)
        return states

    def resume(self) -> None:
        """Restore everything a checkpoint holds, then give the engine the restored weights."""
        t = self.cfg.trainer
        found = resolve_resume(t.resume, t.output_dir)
        path = broadcast_object(str(found) if found else None)  # rank 0's view of the filesystem decides
        if path is None:
            return
        rank_state, shared = self.checkpointer.load(Path(path), self.stateful_models())
        self.policy.scheduler.load_state_dict(shared["scheduler"])
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(shared["critic_scheduler"])
        self.sampler.load_state_dict(rank_state["sampler"])
        set_rng_state(rank_state["rng"])
        self.step, self.history = shared["step"], shared["history"]
        self.summary = shared.get("summary", {})
        rewrite_metrics(t.output_dir, self.history, self.dist.is_main)
        self.sync_weights()
        log_main(self.dist.is_main, f"resumed from step {self.step} ({path})")

    def export(self, out_dir: str) -> None:
        """Collective: gathers full weights; rank 0 writes a plain HF folder."""
        from distflow.export import save_hf_folder

        full = get_model_state_dict(self.policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dist.is_main:
            save_hf_folder(self.model_path, full, out_dir)
        barrier()

    def finish(self, wall_s: float) -> None:
        """End of run: export, summary.json and plots (rank 0 writes)."""
        t = self.cfg.trainer
        if t.export_at_end:
            self.export(os.path.join(t.output_dir, "hf_model"))
        summary = {"steps": self.step, "wall_s": wall_s, "world_size": self.dist.world_size}
        for when in ("before", "after"):
            if when in self.summary:
                summary[f"heldout_pass1_{when}"] = self.summary[when]["val/pass@1"]
                summary["heldout_items"] = int(self.summary[when]["val/items"])
        if "before" in self.summary and "after" in self.summary:
            summary["heldout_pass1_delta"] = summary["heldout_pass1_after"] - summary["heldout_pass1_before"]
        if self.history:
            summary["final_reward_mean"] = self.history[-1]["reward/mean"]
        self.summary_file = write_summary(t.output_dir, summary, self.dist.is_main)
        if t.plot_at_end and self.dist.is_main:
            from distflow.plot import write_plots

            for path in write_plots(t.output_dir):
                self.logger.info(f"plot: {path}")
        for when in ("before", "after"):
            if f"heldout_pass1_{when}" in summary:
                self.logger.info(f"held-out pass@1 {when} training: {summary[f'heldout_pass1_{when}']:.3f} "
                                 f"({summary['heldout_items']} items)")
        if "heldout_pass1_delta" in summary:
            self.logger.info(f"held-out pass@1 change: {summary['heldout_pass1_delta']:+.3f}")
        self.logger.info(f"summary: {self.summary_file}")

    # ----------------------------------------------------------------- metrics
    def step_metrics(self, batch: Rollouts, timing: dict[str, float], upd: dict[str, float], probe: float) -> dict:
        a = self.cfg.algorithm
        resp_lens = [len(s.response_ids) for s in batch.samples] or [0]
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
        sums = {
            "reward_sum": float(batch.rewards.sum()),
            "samples": float(len(batch.samples)),
            "resp_tokens": float(sum(resp_lens)),
            "truncated": float(sum(s.truncated for s in batch.samples)),
            "tokens": float(tokens),
            "kept_groups": float(len(batch.items)),
            "generated_groups": float(batch.generated_groups),
            **{f"reward/{k}": v for k, v in batch.reward_stats.items()},
            **{f"upd/{k}": upd.get(k, 0.0) for k in ("loss", "clip_low", "clip_high", "dual_clip", "kl",
                                                      "entropy", "tis_weight", "tokens", "value_loss",
                                                      "value_clipped", "value_sq_error", "value_sum",
                                                      "value_tokens")},
        }
        maxima = {f"timing/{k}_s": v for k, v in timing.items()}
        maxima.update({"response_length/max": float(max(resp_lens)), "sync/max_abs_logprob_diff": probe,
                       "dynamic_sampling/rounds": float(batch.rounds)})
        g = reduce_step_metrics(sums, maxima, {"timing/update_min_s": timing.get("update", 0.0)})
        n, trained = max(g["samples"], 1.0), max(g["upd/tokens"], 1.0)
        out = {
            "step": self.step,
            "reward/mean": g["reward_sum"] / n,
            "response_length/mean": g["resp_tokens"] / n,
            "response_length/max": g["response_length/max"],
            "response/truncated_frac": g["truncated"] / n,
            **{k: v for k, v in g.items() if k.startswith("timing/")},
            "throughput/tokens_per_s": g["tokens"] / max(g["timing/step_s"], 1e-9),
            "sync/max_abs_logprob_diff": g["sync/max_abs_logprob_diff"],
            "loss/policy": g["upd/loss"],
            "clip/fraction_low": g["upd/clip_low"] / trained,
            "clip/fraction_high": g["upd/clip_high"] / trained,
            "grad_norm": upd.get("grad_norm", 0.0),
            "lr": self.policy.lr,
            **{f"reward/{k}": g[f"reward/{k}"] for k in REWARD_FAILURES},
        }
        if a.dual_clip_c is not None:
            out["clip/fraction_dual"] = g["upd/dual_clip"] / trained
        if a.kl_coef > 0:
            out["loss/kl"] = g["upd/kl"] / trained
        if a.entropy_coef != 0:
            out["loss/entropy"] = g["upd/entropy"] / trained
        if a.tis_cap is not None:
            out["tis/mean_weight"] = g["upd/tis_weight"] / trained
        if self.critic is not None:
            values = max(g["upd/value_tokens"], 1.0)
            out["value/loss"] = g["upd/value_loss"]
            out["value/clip_fraction"] = g["upd/value_clipped"] / values
            out["value/mean"] = g["upd/value_sum"] / values
            out["value/rmse"] = (g["upd/value_sq_error"] / values) ** 0.5
            out["critic/grad_norm"] = upd.get("critic_grad_norm", 0.0)
            out["update/actor_skipped"] = upd.get("actor_skipped", 0.0)
        if self.cfg.trainer.balance_lengths:
            out.update({f"balance/{k}": v for k, v in batch.balance_stats.items()})
        if a.dynamic_sampling:
            out["dynamic_sampling/kept_groups"] = g["kept_groups"]
            out["dynamic_sampling/generated_groups"] = g["generated_groups"]
            out["dynamic_sampling/rounds"] = g["dynamic_sampling/rounds"]
            out["update/skipped"] = upd.get("skipped", 0.0)
        return out

    def close(self) -> None:
        self.logger.close()
        self.scoring_thread.shutdown(wait=True)
        self.rewards.close()
        self.engine.shutdown()
        shutdown()


def resolve_on_local_rank0_first(path: str, local_rank: int) -> str:
    """Built-in models are built or converted once per node: local rank 0 does it while the
    others wait at a barrier, then they only find the finished folder."""
    if local_rank == 0:
        resolved = resolve_model_path(path)
    barrier()
    return resolved if local_rank == 0 else resolve_model_path(path)


def check_same_config(cfg: DistflowConfig, output_dir: str, is_main: bool) -> None:
    """Every rank must run the same config (a stray override on one node would silently
    diverge the SPMD program): compare a hash across ranks; rank 0 saves the resolved config."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "little")  # exact in float64
    low, high = all_reduce(digest, "min"), all_reduce(digest, "max")
    if int(low) != int(high):
        raise ConfigError(f"the resolved config differs between ranks (hashes {int(low):x} vs {int(high):x}); "
                          "launch every rank with the same overrides")
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
            f.write(text)


def inject_fault(spec: str, rank: int, step: int) -> None:
    """Test-only: trainer.fault_inject="RANK:STEP[:kill|raise]" fails that rank mid-step,
    on the first attempt only (torchrun restarts set TORCHELASTIC_RESTART_COUNT)."""
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    f_rank, f_step, *mode = spec.split(":")
    if int(f_rank) == rank and int(f_step) == step:
        if (mode or ["kill"])[0] == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def rewrite_metrics(output_dir: str, history: list[dict], is_main: bool) -> None:
    """On resume, metrics.jsonl becomes exactly the checkpoint's history: steps a killed run
    logged after its last checkpoint are dropped, so each step appears once."""
    if not is_main:
        return
    with open(os.path.join(output_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(m) + "\n" for m in history)


def write_summary(output_dir: str, summary: dict, is_main: bool) -> str:
    path = os.path.join(output_dir, "summary.json")
    if is_main:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return path


def log_main(is_main: bool, message: str) -> None:
    if is_main:
        print(f"distflow: {message}", flush=True)


class _timed:
    """Adds the wall time of the block to out[key] (so repeated phases accumulate)."""

    def __init__(self, out: dict[str, float], key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.out[self.key] = self.out.get(self.key, 0.0) + time.perf_counter() - self.t
