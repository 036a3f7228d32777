"""Advantage estimators.

Every estimator in `ADVANTAGE_ESTIMATORS` (see registry.py) has one signature

    fn(inputs: AdvantageInputs, cfg: AlgorithmConfig, global_sum: GlobalSum)
        -> (advantages [N, R], returns [N, R] or None)

per response token, for the N samples of a rank in group-major order (group_size consecutive
samples per prompt). The sequence-level estimators (GRPO, RLOO) are pure functions of scalar
rewards laid out as [num_groups, G]; `sequence_estimator` lifts one into the common signature
(scalar = outcome reward + the sum of the token rewards, spread over the response's tokens).
REINFORCE++ and REINFORCE++-baseline work per token (whitened over the valid tokens of every
rank), GAE per token with the critic's values.

Equal groups: a group whose rewards are all equal carries no signal, and every group-relative
estimator gives it exactly 0 — not the ulp noise of a float32 mean divided by a std of 0 + eps.

A sample may train as several rows (a harness episode's branches, `AdvantageInputs.sample_of`):
scores stay one per sample, group statistics are the samples', and each row carries its sample's
advantage (per token: its sample's outcome reward on its own last token).

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
    """What an estimator sees, for the N samples of a rank (group-major): scores per sample, the
    [rows, R] tensors per row (one per sample unless `sample_of` maps them)."""

    scores: torch.Tensor  # [N] outcome reward per sample, after shaping (distflow.rollout.scoring.shape_rewards)
    token_rewards: torch.Tensor  # [N, R] per-token rewards (e.g. -beta * KL), 0 on padding
    mask: torch.Tensor  # [N, R] 1 on generated response tokens (0 on padding and observation tokens)
    values: Optional[torch.Tensor] = None  # [N, R] the critic's V(state before token t), for GAE
    # [N, R] log pi_student - log pi_teacher of each sampled token, for on-policy distillation
    teacher_log_ratio: Optional[torch.Tensor] = None
    # [rows] the sample each row belongs to, when a sample trains as several rows; None: row i is sample i
    sample_of: Optional[torch.Tensor] = None

    def sequence_rewards(self) -> torch.Tensor:
        """[N] float32: each sample's outcome reward plus the sum of its valid token rewards (over
        all its rows)."""
        m = self.mask.to(torch.float32)
        scores, tokens = self.scores.reshape(-1).to(torch.float32), (self.token_rewards.to(torch.float32) * m).sum(-1)
        if self.sample_of is not None:
            tokens = torch.zeros_like(scores).index_add_(0, self.sample_of.to(scores.device), tokens)
        return scores + tokens

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """A per-sample [N, ...] tensor as per row."""
        return x if self.sample_of is None else x[self.sample_of.to(x.device)]


Estimator = Callable[[AdvantageInputs, AlgorithmConfig, GlobalSum], tuple[torch.Tensor, Optional[torch.Tensor]]]


def local_sum(values: list) -> list:
    """The `global_sum` of a single process holding the whole batch: the identity."""
    return values


def _check_2d(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    return rewards.to(torch.float32)


def equal_groups(rewards: torch.Tensor) -> torch.Tensor:
    """bool [num_groups]: True where every reward of the group is exactly the same."""
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def _zero_equal_groups(advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    return torch.where(equal_groups(rewards)[:, None], torch.zeros_like(advantages), advantages)


def group_normalized_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps); without `scale`, only the mean is removed.

    The std is the unbiased sample std (torch's default, as in TRL and verl). All samples of a
    group live on one rank, so this needs no communication. A group whose rewards are all equal
    gets exactly zero advantages (no signal), never NaN or rounding noise.
    """
    rewards = _check_2d(rewards)
    out = rewards - rewards.mean(dim=1, keepdim=True)
    if scale and rewards.numel():
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
        out = out / (std + eps)
    return _zero_equal_groups(out, rewards)


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
    return _zero_equal_groups(rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1), rewards)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """[N] column of each row's last valid token (-1 for a row with none); masks may have holes
    (a multi-turn episode's observation tokens)."""
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, cols, torch.full_like(cols, -1)).amax(dim=1) if mask.shape[1] else \
        torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)


def _outcome_token_rewards(inputs: AdvantageInputs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, R] token rewards with each sample's outcome reward added on its last valid token (an
    empty response has no token to carry it)."""
    m = inputs.mask.to(dtype)
    token_rewards = inputs.token_rewards.to(dtype) * m
    last = last_valid_index(m)
    rows = (last >= 0).nonzero().flatten()
    token_rewards[rows, last[rows]] += inputs.per_row(inputs.scores.reshape(-1).to(dtype))[rows]
    return token_rewards


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over each row's valid tokens, [N, R] (0 on padding). Masked
    positions inside a row (observation tokens) are skipped: the recursion runs over the valid
    tokens only, as if the others were not there."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(m[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_pp_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig,
                            global_sum: GlobalSum) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (Hu 2025; verl's reinforce_plus_plus), any group size.

    Per token: the outcome reward on the last token plus the token rewards (-beta * KL with
    algorithm.kl_in_reward), returns discounted with algorithm.gamma (G_t = r_t + gamma G_{t+1}),
    then whitened over the valid tokens of ALL ranks (mean and Bessel-corrected std over tokens):
    long responses weigh more, empty ones are left out.
    """
    m = inputs.mask.to(torch.float32)
    returns = discounted_returns(_outcome_token_rewards(inputs), m, cfg.gamma)
    return whiten_global(returns, global_sum, cfg.eps, mask=m), None


def reinforce_pp_baseline_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig,
                                     global_sum: GlobalSum) -> tuple[torch.Tensor, None]:
    """REINFORCE++-baseline (Hu 2025; verl's reinforce_plus_plus_baseline).

    Each sample's scalar (outcome reward + the sum of its token rewards) minus its group's mean,
    spread over its response tokens, then whitened over the valid tokens of ALL ranks. A group
    whose scalars are all equal gets exactly 0 (verl would give it -mean/std of the batch).
    """
    m = inputs.mask.to(torch.float32)
    scalar = inputs.sequence_rewards()
    groups = scalar.view(-1, cfg.group_size)
    centered = inputs.per_row(_zero_equal_groups(groups - groups.mean(dim=1, keepdim=True), groups).reshape(-1))
    adv = whiten_global(centered[:, None].to(m.device) * m, global_sum, cfg.eps, mask=m)
    equal = inputs.per_row(equal_groups(groups).repeat_interleave(cfg.group_size)).to(m.device)
    return torch.where(equal[:, None], torch.zeros_like(adv), adv), None


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
        scalar = inputs.sequence_rewards()
        adv = inputs.per_row(fn(scalar.view(-1, cfg.group_size), cfg, global_sum).reshape(-1))
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
    m = inputs.mask.to(values.dtype)
    adv, returns = gae(_outcome_token_rewards(inputs, values.dtype), values, m, cfg.gamma, cfg.lam)
    return whiten_global(adv, global_sum, cfg.eps, mask=m), returns


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): bool [num_groups], True where a group's rewards differ.

    Groups with all-equal rewards have zero group-relative advantage and only dilute the batch.
    Exact comparison: rewards computed the same way compare equal.
    """
    return ~equal_groups(_check_2d(rewards))


def overlong_penalty(resp_lens: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: 0 up to max-buffer, linear to -penalty at max.

    Lengths beyond max_new_tokens get -penalty. buffer_len = 0 turns it off (all zeros).
    """
    lens = torch.as_tensor(resp_lens, dtype=torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lens)
    exceed = lens - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * penalty).clamp(min=-penalty, max=0.0)
