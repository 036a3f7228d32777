"""Advantage estimators. Inputs are per-sample scalar rewards laid out as [num_groups, group_size]."""

from __future__ import annotations

import torch


def group_normalized_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps); without `scale`, only the mean is removed.

    The std is the unbiased sample std (torch's default, as in TRL and verl). All samples of a
    group live on one rank, so this needs no communication. A group whose rewards are all equal
    gets zero advantages (no signal), never NaN.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centered
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    return centered / (std + eps)
