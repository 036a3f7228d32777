"""Advantage estimators.

Every estimator in `ADVANTAGE_ESTIMATORS` (see registry.py) has one signature

    fn(inputs: AdvantageInputs, cfg: AlgorithmConfig, global_sum: GlobalSum)
        -> (advantages [N, R], returns [N, R] or None)

per response token, for the N samples of a rank in group-major order (group_size consecutive
samples per prompt). The sequence-level estimators (GRPO, RLOO, REINFORCE++ and its baseline
variant) are pure functions of scalar rewards laid out as [num_groups, G]; `sequence_estimator`
lifts one into the common signature (scalar = outcome reward + the sum of the token rewards,
spread over the response's tokens).

All samples of a group live on one rank, so group statistics are local. Batch-wide statistics
(REINFORCE++ whitening) come only through `global_sum`, which must sum a short list of floats
over all ranks (`distflow.distributed.all_reduce` does; `local_sum` is the 1-process case). It is
a collective: every rank must call the estimator, even one holding zero groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from distflow.config import AlgorithmConfig

GlobalSum = Callable[[list], Union[Sequence[float], torch.Tensor]]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator sees, for the N samples of a rank (group-major)."""

    scores: torch.Tensor  # [N] outcome reward per sample, after shaping (distflow.scoring.shape_rewards)
    token_rewards: torch.Tensor  # [N, R] per-token rewards (e.g. -beta * KL), 0 on padding
    mask: torch.Tensor  # [N, R] 1 on valid response tokens
    values: Optional[torch.Tensor] = None  # [N, R] the critic's V(state before token t), for GAE


Estimator = Callable[[AdvantageInputs, AlgorithmConfig, GlobalSum], tuple[torch.Tensor, Optional[torch.Tensor]]]


def local_sum(values: list) -> list:
    """The `global_sum` of a single process holding the whole batch: the identity."""
    return values


def _check_2d(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    return rewards.to(torch.float32)


def group_normalized_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps); without `scale`, only the mean is removed.

    The std is the unbiased sample std (torch's default, as in TRL and verl). All samples of a
    group live on one rank, so this needs no communication. A group whose rewards are all equal
    gets zero advantages (no signal), never NaN.
    """
    rewards = _check_2d(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale or rewards.numel() == 0:
        return centered
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    return centered / (std + eps)


def whiten_global(x: torch.Tensor, global_sum: GlobalSum, eps: float = 1e-6,
                  mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean/std over the valid entries of ALL ranks (one all-reduce).

    Statistics come from the global sum, sum of squares and count, accumulated in float64. The
    std is the unbiased (n-1) estimate, like torch.std, GRPO's group std and verl's masked_whiten;
    with fewer than 2 valid entries globally it is taken as 0. Masked entries come out as 0.
    """
    m = torch.ones_like(x, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    x64 = x.to(torch.float64) * m
    local = [float(x64.sum()), float((x64 * x64).sum()), float(m.sum())]
    total, total_sq, n = (float(v) for v in torch.as_tensor(global_sum(local), dtype=torch.float64).reshape(-1))
    mean = total / n if n > 0 else 0.0
    var = max(total_sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    out = (x.to(torch.float64) - mean) / (var**0.5 + eps) * m
    return out.to(torch.float32)


def grpo_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig, global_sum: GlobalSum) -> torch.Tensor:
    """GRPO (Shao et al. 2024); scale_rewards=False is Dr. GRPO (Liu et al. 2025). Local only."""
    return group_normalized_advantages(rewards, cfg.scale_rewards, cfg.eps)


def rloo_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig, global_sum: GlobalSum) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the other G-1 rewards of its group."""
    rewards = _check_2d(rewards)
    g = rewards.shape[1]
    if g < 2:
        raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline of an empty set)")
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)


def reinforce_pp_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig, global_sum: GlobalSum) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): outcome returns whitened with the global batch mean/std; any group size."""
    rewards = _check_2d(rewards)
    return whiten_global(rewards, global_sum, cfg.eps)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig,
                                     global_sum: GlobalSum) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten globally."""
    rewards = _check_2d(rewards)
    return whiten_global(rewards - rewards.mean(dim=1, keepdim=True), global_sum, cfg.eps)


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) for PPO over response tokens; returns (advantages, returns), [B, T].

    values[:, t] is V(state before token t), on the same positions as the rewards. Masked
    positions are skipped (the recursion jumps over them, as in verl) and the value after the
    last valid token is 0 (terminal). No whitening: call `whiten_global(adv, global_sum, mask=mask)`.
    """
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        cand = delta + gamma * lam * last
        last = torch.where(m[:, t] > 0, cand, last)
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        out[:, t] = last
    adv = out * m
    return adv, (adv + values) * m


def sequence_estimator(fn: Callable[[torch.Tensor, AlgorithmConfig, GlobalSum], torch.Tensor]) -> Estimator:
    """Lift a scalar estimator ([num_groups, G] -> [num_groups, G]) into the common signature:
    each sample's scalar is its outcome reward plus the sum of its token rewards, and its
    advantage is spread over its response tokens. There are no returns (no critic)."""

    def estimate(inputs: AdvantageInputs, cfg: AlgorithmConfig, global_sum: GlobalSum):
        m = inputs.mask.to(torch.float32)
        scalar = inputs.scores.reshape(-1).to(torch.float32) + (inputs.token_rewards.to(torch.float32) * m).sum(-1)
        adv = fn(scalar.view(-1, cfg.group_size), cfg, global_sum).reshape(-1)
        return adv[:, None].to(m.device) * m, None

    estimate.__name__ = estimate.__qualname__ = fn.__name__
    estimate.__doc__ = fn.__doc__
    return estimate


def gae_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig,
                   global_sum: GlobalSum) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's estimator: token-level (advantages, returns), [N, T], from one scalar reward per sample.

    The outcome reward lands on each response's last token, on top of the token rewards (e.g.
    -beta * KL per token, as verl's kl_in_reward). GAE runs per sample with cfg.gamma and
    cfg.lam; advantages are then whitened over the valid tokens of ALL ranks (one all-reduce),
    while returns — the critic's regression targets — stay unwhitened. An empty response has no
    token to carry its reward and contributes nothing.
    """
    if inputs.values is None:
        raise ValueError("gae needs the critic's values")
    values = inputs.values
    rewards = inputs.scores.reshape(-1).to(values.dtype)
    m = inputs.mask.to(values.dtype)
    token_rewards = inputs.token_rewards.to(values.dtype) * m
    lengths = m.sum(-1).long()
    rows = (lengths > 0).nonzero().flatten()
    token_rewards[rows, lengths[rows] - 1] += rewards[rows]
    adv, returns = gae(token_rewards, values, m, cfg.gamma, cfg.lam)
    return whiten_global(adv, global_sum, cfg.eps, mask=m), returns


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): bool [num_groups], True where a group's rewards differ.

    Groups with all-equal rewards have zero group-relative advantage and only dilute the batch.
    Exact comparison: rewards computed the same way compare equal.
    """
    rewards = _check_2d(rewards)
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def overlong_penalty(resp_lens: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: 0 up to max-buffer, linear to -penalty at max.

    Lengths beyond max_new_tokens get -penalty. buffer_len = 0 turns it off (all zeros).
    """
    lens = torch.as_tensor(resp_lens, dtype=torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lens)
    exceed = lens - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * penalty).clamp(min=-penalty, max=0.0)
