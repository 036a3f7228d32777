"""Advantage estimators, policy losses, KL estimators, the rollout correction and loss aggregation: small pure functions of tensors.

An algorithm is a config choosing among these by name (registry.py); the trainer never branches
on its name.
"""

from distflow.algorithms.advantages import (
    AdvantageInputs,
    Estimator,
    GlobalSum,
    discounted_returns,
    dynamic_sampling_keep,
    equal_groups,
    gae,
    gae_advantages,
    group_normalized_advantages,
    grpo_advantages,
    local_sum,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_estimator,
    whiten_global,
)
from distflow.algorithms.kl import KL_ESTIMATORS, entropy_from_logits, kl_penalty, sequence_kl, token_kl
from distflow.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate_denominator,
    aggregate_numerator,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
)
from distflow.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_ESTIMATORS,
    POLICY_LOSSES,
    SEQUENCE_ESTIMATORS,
    compute_token_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "Estimator",
    "discounted_returns",
    "equal_groups",
    "SEQUENCE_ESTIMATORS",
    "sequence_estimator",
    "CRITIC_ESTIMATORS",
    "GlobalSum",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "aggregate_denominator",
    "aggregate_numerator",
    "cispo_loss",
    "compute_token_loss",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "gae",
    "gae_advantages",
    "group_normalized_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "local_sum",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_kl",
    "token_kl",
    "value_loss",
    "whiten_global",
]
