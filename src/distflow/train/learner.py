"""The learner: everything that trains, as one component the trainer drives.

It holds the policy, the frozen reference (only with KL on), the critic (only for estimators
that need values), the distillation teacher (only for advantage=distill) and the updater, and turns a step's samples and rewards into an optimizer
step: batch -> plan -> logprobs -> advantages -> update. It also hands out what the engine must
load after an update (the weight stream, or a LoRA policy's adapters). Nothing here knows about engines, tasks or the run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, ContextManager, Iterator

import torch

from distflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from distflow.algorithms.distill import distill_vector
from distflow.algorithms.rollout_correction import importance_weight_sums
from distflow.config import DistflowConfig, RolloutCorrectionConfig
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.sample import Sample, training_rows
from distflow.train.batch import CURRENT_POLICY, OldLogprobs, UpdateBatch
from distflow.train.critic import Critic
from distflow.train.lora import adapter_tensors
from distflow.train.policy import Policy
from distflow.train.shaping import shape_rewards
from distflow.train.update import StepPlan, Updater, UpdateResult
from distflow.train.weight_stream import full_parameters

log = logging.getLogger("distflow")


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """The forward passes before the update: old (sampling-time) and reference logprobs, values,
    and log pi_student - log pi_teacher of each token (distillation)."""

    old: OldLogprobs
    ref: torch.Tensor | None
    values: torch.Tensor | None
    teacher_log_ratio: torch.Tensor | None = None


def importance_weight_scale(rc: RolloutCorrectionConfig, old: torch.Tensor, batch: UpdateBatch) -> float:
    """1 / the mean truncated importance weight over every rank's batch (a collective: one
    all_reduce), for the rollout correction's batch normalisation; `old` are the old logprobs."""
    total, count = importance_weight_sums(old, batch.sampling_logprobs, batch.loss_mask, rc)
    total, count = all_reduce(torch.stack([total, count])).tolist()
    return count / total if total > 0 else 1.0


class Learner:
    def __init__(self, cfg: DistflowConfig, layout: ParallelLayout, model_path: str, critic_path: str, pad_id: int,
                 phase: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext(),
                 teacher_path: str | None = None):
        """`phase`: the phase clock (PhaseTimer.phase), around each model's load and the teacher's
        forward; `teacher_path`: the distillation teacher's local folder (advantage=distill)."""
        a = cfg.algorithm
        self.cfg, self.pad_id, self.phase = cfg, pad_id, phase
        self.updater = Updater(cfg, pad_id)  # plans each batch's passes once, runs them
        with phase("startup:policy"):
            self.policy = Policy(model_path, cfg.model, cfg.optim, layout)
            # The frozen reference exists only when KL is on or measured: beta = 0 costs nothing. With
            # LoRA it is the policy with its adapters off.
            self.reference = None if not a.needs_reference else self.policy.base() if self.policy.lora \
                else Policy(model_path, cfg.model, cfg.optim, layout, trainable=False)
        # The critic exists only for estimators that need values (PPO's GAE).
        with phase("startup:critic"):
            self.critic = Critic(critic_path, cfg.critic, cfg.model, cfg.optim, layout) if cfg.has_critic else None
        # The teacher exists only for distillation: frozen, built and sharded as the reference is.
        self.teacher = None
        if a.needs_teacher:
            with phase("startup:teacher"):
                self.teacher = Policy(teacher_path or cfg.teacher.path, cfg.model, cfg.optim, layout, trainable=False,
                                      offload=cfg.teacher.offload)
        self.estimator = ADVANTAGE_ESTIMATORS[a.advantage]

    def batch(self, samples: list[Sample], current_version: int) -> UpdateBatch:
        """The step's one padded batch (micro-batches are row selections of it). Tokens of versions
        older than `current_version` (carried over) leave the mismatch measurement."""
        rows, sample_of = training_rows(samples)
        batch = UpdateBatch.from_samples(rows, self.pad_id, self.policy.device, self.cfg.algorithm.overlong_filter)
        if sample_of is not None:  # a harness episode's trajectories: one row each, one advantage
            device = self.policy.device
            batch = batch.with_(sample_of=torch.tensor(sample_of, dtype=torch.long, device=device),
                                sample_resp_len=torch.tensor([len(s.response_ids) for s in samples], device=device))
        versions = batch.token_versions
        if versions is not None:
            batch = batch.with_(token_lag=current_version - versions)
        if versions is not None and bool((versions != current_version)[batch.loss_mask.bool()].any()):
            batch = batch.with_(mismatch_mask=batch.loss_mask * (versions == current_version))
        return batch

    def plan(self, batch: UpdateBatch) -> StepPlan:
        return self.updater.plan(batch.tokens)

    def logprobs(self, plan: StepPlan) -> Logprobs:
        a, o, u = self.cfg.algorithm, self.cfg.optim, self.updater
        rc = a.rollout_correction
        # With one optimizer step per rollout the policy that sampled is the one being trained; in
        # bypass mode the engine's logprobs stand in for the old ones whatever the step count.
        several = (a.ppo_epochs > 1 or o.mini_batches > 1) and not rc.bypass_mode
        needs_old = several or (a.kl_coef > 0 and a.kl_in_reward) or rc.rollout_is_batch_normalize
        old = u.logprobs(self.policy, plan) if needs_old else CURRENT_POLICY
        ref = u.logprobs(self.reference, plan) if self.reference else None
        values = u.values(self.critic, plan) if self.critic else None
        ratio = None
        if self.teacher is not None:  # the student's own pass when the update would not need one
            student = old if old is not CURRENT_POLICY else u.logprobs(self.policy, plan)
            with self.phase("teacher"):
                ratio = student - u.logprobs(self.teacher, plan)
        return Logprobs(old, ref, values, ratio)

    def advantages(self, batch: UpdateBatch, rewards: torch.Tensor, lp: Logprobs) -> UpdateBatch:
        old = lp.old if lp.old is not CURRENT_POLICY else None
        scores, token_rewards = shape_rewards(rewards, batch.tokens, self.cfg.algorithm,
                                              self.cfg.rollout.response_budget(), old, lp.ref, batch.resp_len)
        inputs = AdvantageInputs(scores, token_rewards, batch.tokens.resp_mask, lp.values,  # all on the device
                                 lp.teacher_log_ratio, batch.sample_of)
        advantages, returns = self.estimator(inputs, self.cfg.algorithm, lambda v: all_reduce(v).tolist())
        rc = self.cfg.algorithm.rollout_correction
        scale = importance_weight_scale(rc, lp.old, batch) if rc.rollout_is_batch_normalize else 1.0
        return batch.with_(advantages=advantages, old_logprobs=lp.old, ref_logprobs=lp.ref, values=lp.values,
                           returns=returns, is_weight_scale=scale, teacher_log_ratio=lp.teacher_log_ratio)

    def update(self, batch: UpdateBatch, plan: StepPlan, step: int) -> UpdateResult:
        """The optimizer steps over `plan`; none if no group is left anywhere, the critic's alone in its warm-up."""
        distill = distill_vector(batch.teacher_log_ratio, batch.loss_mask).tolist() \
            if batch.teacher_log_ratio is not None else None
        if int(all_reduce(len(batch))) == 0:
            log.info(f"step {step}: every group was filtered out; update skipped")
            return UpdateResult(skipped=True, distill=distill)
        train_actor = self.critic is None or step > self.cfg.critic.warmup_steps
        result = self.updater.optimize(self.policy if train_actor else None, self.critic, batch, plan)
        return dataclasses.replace(result, distill=distill)

    @property
    def sends_adapter(self) -> bool:
        """A LoRA policy with model.lora.resync=adapter sends its adapters, not merged weights."""
        return self.policy.lora and self.cfg.model.lora.resync == "adapter"

    def adapter(self) -> tuple[dict[str, torch.Tensor], object]:
        """(PEFT-named adapter tensors, PEFT config): what an engine loads as a LoRA adapter."""
        return adapter_tensors(self.policy.model), self.policy.adapter_config

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full weights (a LoRA policy's merged) in the engine's dtype, bucket by bucket
        (a collective: every rank consumes the whole stream)."""
        bucket = self.cfg.rollout.sync_bucket_mib << 20
        return full_parameters(self.policy.model, getattr(torch, self.cfg.model.dtype), bucket)
