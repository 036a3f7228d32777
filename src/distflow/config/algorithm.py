"""The algorithm section: the estimator, the policy loss, KL, the rollout correction, and DAPO's
and PPO's knobs. The names here are the keys of distflow.algorithms.registry's function tables."""

from __future__ import annotations

from typing import Literal, Optional

from distflow.config.fields import knob, section
from distflow.config.rollout_correction import RolloutCorrectionConfig

Advantage = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "distill"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# Estimators that need a critic's token-level values: the critic exists exactly for these.
CRITIC_ESTIMATORS = ("gae",)
# Estimators whose baseline is the sample's own group: useless (or undefined) with group_size 1.
GROUP_RELATIVE = ("grpo", "rloo", "reinforce_pp_baseline")


@section
class AlgorithmConfig:
    name: str = knob("grpo", "A label for the run (the algorithm groups set it); nothing branches on it.")
    group_size: int = knob(4, "Samples per prompt, all generated and scored on the same rank.")
    advantage: Advantage = knob("grpo", "The advantage estimator (docs/algorithms.md); gae trains a critic; distill "
                                "learns from teacher.path's log-probabilities (on-policy distillation).")
    scale_rewards: bool = knob(True, "Divide by the group std (GRPO); false: Dr. GRPO style.")
    policy_loss: PolicyLoss = knob(
        "ppo_clip", "The policy loss. gspo clamps each token's log-ratio to +-20 before the sequence mean and the "
        "sequence log-ratio at 10 (as verl); cispo caps its IS weight at 1 + clip_eps_high with no lower bound, as "
        "the paper does (clip_eps_low is ignored).")
    clip_eps_low: float = knob(0.2, "PPO's lower clip range: the ratio is clipped at 1 - clip_eps_low.")
    clip_eps_high: float = knob(0.2, "PPO's upper clip range (DAPO's clip-higher raises it).")
    dual_clip_c: Optional[float] = knob(
        None, "Dual-clip bound c for negative advantages (Ye et al. 2020). Off by default, where verl's default is "
        "c = 3: set 3.0 for verl's behaviour.")
    loss_agg_mode: LossAggMode = knob(
        "token-mean", "How token losses become the loss. The seq-mean modes divide by the number of sequences "
        "including fully masked ones (e.g. dropped by the overlong filter), as verl's original agg_loss (newer verl "
        "leaves them out); seq-mean-token-sum-norm divides each sequence's token sum by the response budget (a "
        "constant, Dr. GRPO's), where verl divides by the padded response width unless given a loss_scale_factor.")
    ppo_epochs: int = knob(1, "Passes over each rollout batch.")
    eps: float = knob(
        1e-6, "Added to the std when whitening: (x - mean) / (std + eps). verl's masked_whiten uses (x - mean) * "
        "rsqrt(var + 1e-8); the two differ only when the std is near 0.")
    kl_coef: float = knob(0.0, "KL to a frozen reference policy; 0 builds no reference model at all (unless "
                          "kl_metric).")
    kl_estimator: KLEstimator = knob("k3", "k1, k2 or k3 (Schulman 2020; verl's kl, mse, low_var_kl).")
    kl_in_reward: bool = knob(False, "Subtract kl_coef * KL from the rewards, per token, instead of adding it to the "
                              "loss.")
    kl_metric: bool = knob(
        False, "Build the frozen reference (the initial policy) even at kl_coef = 0 and report loss/kl, the "
        "policy's KL to it on the sampled tokens (kl_estimator, the token mean over the update's passes; with one "
        "optimizer step per batch, the policy before the step): how far training has moved the policy, at the cost "
        "of the reference's memory and one more forward per step. The loss is unchanged.")
    entropy_coef: float = knob(0.0, "Entropy bonus weight.")
    rollout_correction: RolloutCorrectionConfig = knob(factory=RolloutCorrectionConfig)
    dynamic_sampling: bool = knob(False, "DAPO's dynamic sampling: drop groups whose rewards are all equal and "
                                  "resample, up to max_sampling_rounds.")
    max_sampling_rounds: int = knob(3, "Generation rounds per step with dynamic sampling.")
    overlong_filter: bool = knob(False, "DAPO's overlong filter: truncated samples leave the loss.")
    overlong_buffer_len: int = knob(0, "DAPO's soft overlong punishment over this many tokens before the response "
                                    "budget; 0: off.")
    overlong_penalty: float = knob(1.0, "The soft overlong punishment's largest penalty.")
    distill_reward_weight: float = knob(
        0.0, "advantage=distill: each token's advantage is -(log pi_student - log pi_teacher) plus this weight "
        "times the task reward's GRPO advantage (group-normalised, the same on every token of a sample); 0: the "
        "teacher alone (the rewards are still scored and reported).")
    gamma: float = knob(1.0, "Discount of the per-token returns (GAE and REINFORCE++); 1: undiscounted.")
    lam: float = knob(1.0, "GAE's lambda.")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.kl_metric

    @property
    def needs_teacher(self) -> bool:
        return self.advantage == "distill"

    @property
    def needs_critic(self) -> bool:
        return self.advantage in CRITIC_ESTIMATORS

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.group_size >= 1, f"algorithm.group_size must be >= 1, got {self.group_size}"),
            (self.group_size >= 2 or self.advantage not in GROUP_RELATIVE,
             f"algorithm.advantage={self.advantage} is group-relative and needs group_size >= 2, got {self.group_size}"),
            (self.group_size >= 2 or not self.dynamic_sampling,
             "algorithm.dynamic_sampling needs group_size >= 2 (a group of one always has equal rewards)"),
            (0 <= self.clip_eps_low <= self.clip_eps_high,
             f"need 0 <= algorithm.clip_eps_low <= clip_eps_high, got {self.clip_eps_low}, {self.clip_eps_high}"),
            (self.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {self.kl_coef}"),
            (self.dual_clip_c is None or self.dual_clip_c > 1,
             f"algorithm.dual_clip_c must be > 1 (or null), got {self.dual_clip_c}"),
            (self.max_sampling_rounds >= 1,
             f"algorithm.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}"),
            (self.overlong_buffer_len >= 0,
             f"algorithm.overlong_buffer_len must be >= 0, got {self.overlong_buffer_len}"),
            (self.overlong_penalty >= 0, f"algorithm.overlong_penalty must be >= 0, got {self.overlong_penalty}"),
            (self.distill_reward_weight >= 0,
             f"algorithm.distill_reward_weight must be >= 0, got {self.distill_reward_weight}"),
            (not self.needs_teacher or self.distill_reward_weight == 0 or self.group_size >= 2,
             "algorithm.distill_reward_weight > 0 adds the task reward's group-relative advantage and needs "
             f"group_size >= 2, got {self.group_size}"),
            (self.eps > 0, f"algorithm.eps must be > 0, got {self.eps}"),
            (self.ppo_epochs >= 1, f"algorithm.ppo_epochs must be >= 1, got {self.ppo_epochs}"),
            (0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
             f"algorithm.gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}"),
            *self.rollout_correction.checks(),
        ]
