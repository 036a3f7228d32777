"""Policy losses and the aggregation of per-token losses into one scalar.

Aggregation is split into a local numerator and a global denominator so that a batch sharded
over ranks and micro-batches yields exactly the gradient of the whole batch on one process:
the caller all-reduces the denominator once per optimizer step and divides each micro-batch's
numerator by it.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective per token: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    logprobs/old_logprobs: [B, T]; advantages: [B] (one per sequence) or [B, T].
    Returns the per-token loss and boolean masks of where the clip was active (low/high).
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        info = {
            "clip_low": (ratio < 1.0 - eps_low) & (adv < 0),
            "clip_high": (ratio > 1.0 + eps_high) & (adv > 0),
            "ratio": ratio.detach(),
        }
    return loss, info


def aggregate_numerator(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int) -> torch.Tensor:
    """This shard's share of the aggregated loss, before division by `aggregate_denominator`."""
    mask = mask.to(token_loss.dtype)
    per_seq = (token_loss * mask).sum(dim=-1)
    if mode in ("token-mean", "seq-mean-token-sum"):
        return per_seq.sum()
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=-1).clamp(min=1)).sum()
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / max_tokens
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {LOSS_AGG_MODES}")


def aggregate_denominator(mask: torch.Tensor, mode: str) -> float:
    """This shard's contribution to the global denominator (to be summed over ranks)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode in LOSS_AGG_MODES:
        return float(mask.shape[0])
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {LOSS_AGG_MODES}")
