"""Name -> function tables for the algorithm knobs, and the composed token loss.

The trainer looks functions up here by the config's names and never branches on them; the names
are the choices distflow.config.algorithm declares (a unit test holds the two together).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from distflow.algorithms.advantages import (
    Estimator,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_estimator,
)
from distflow.algorithms.distill import distill_advantages
from distflow.algorithms.kl import KL_ESTIMATORS, kl_penalty
from distflow.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss
from distflow.algorithms.rollout_correction import rollout_correction
from distflow.config import CRITIC_ESTIMATORS, AlgorithmConfig

# fn(rewards [num_groups, G], cfg, global_sum) -> advantages [num_groups, G]: one per sequence.
SEQUENCE_ESTIMATORS: dict[str, Callable] = {"grpo": grpo_advantages, "rloo": rloo_advantages}
# fn(AdvantageInputs, cfg, global_sum) -> (advantages [N,R], returns [N,R] or None): the trainer's one signature.
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    **{name: sequence_estimator(fn) for name, fn in SEQUENCE_ESTIMATORS.items()},
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
    "distill": distill_advantages,
}

# fn(logp [B,T], old_logp [B,T], advantages [B] | [B,T], mask [B,T], cfg) -> (token_loss [B,T], info)
POLICY_LOSSES: dict[str, Callable] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}

__all__ = ["ADVANTAGE_ESTIMATORS", "CRITIC_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "SEQUENCE_ESTIMATORS",
           "compute_token_loss"]


def compute_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    engine_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    weight_scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The full per-token loss for one micro-batch, [B, T], ready for aggregate_numerator.

    policy_loss(logp, old) * correction.weight   (old := engine_logp in bypass mode)
      + kl_coef * kl_penalty(logp, ref)          (if kl_coef > 0 and not kl_in_reward)
      - entropy_coef * entropy                   (if entropy_coef != 0; entropy [B,T] WITH gradient)
    The rollout correction (distflow.algorithms.rollout_correction) runs whenever engine_logp is
    given, its weight being exactly 1 when it is off; info["correction"] is its Correction.
    `weight_scale` is the batch normalisation of its importance weights. Raises ValueError when an
    input the config asks for is missing. info adds "kl", "entropy" ([B,T], detached) when those
    terms are active ("kl" also with kl_metric, whose reference logprobs are given but not added).
    """
    rc = cfg.rollout_correction
    if engine_logp is None and rc.active:
        raise ValueError("algorithm.rollout_correction is on but no engine (sampling) logprobs were given")
    correction = None
    if engine_logp is not None:
        proximal = logp.detach() if rc.bypass_mode else old_logp
        old_logp = engine_logp.to(old_logp.dtype) if rc.bypass_mode else old_logp
        correction = rollout_correction(proximal, engine_logp, mask, rc, weight_scale)
    loss, info = POLICY_LOSSES[cfg.policy_loss](logp, old_logp, advantages, mask, cfg)
    m = mask.bool()
    if correction is not None:
        loss, info["correction"] = loss * correction.weight, correction
    kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward
    if kl_in_loss and ref_logp is None:
        raise ValueError("algorithm.kl_coef > 0 needs reference-policy logprobs")
    if ref_logp is not None and (kl_in_loss or cfg.kl_metric):
        kl = kl_penalty(torch.where(m, logp, 0.0), torch.where(m, ref_logp, 0.0), cfg.kl_estimator)
        info["kl"] = kl.detach() * m
        if kl_in_loss:
            loss = loss + cfg.kl_coef * torch.where(m, kl, 0.0)
    if cfg.entropy_coef != 0:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef != 0 needs per-token entropy (entropy_from_logits)")
        ent = torch.where(m, entropy, 0.0)
        loss, info["entropy"] = loss - cfg.entropy_coef * ent, ent.detach()
    return loss, info
