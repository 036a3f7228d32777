"""Policy losses and the aggregation of per-token losses into one scalar.

Aggregation is split into a local numerator and a global denominator so that a batch sharded
over ranks and micro-batches yields exactly the gradient of the whole batch on one process:
the caller all-reduces the denominator once per optimizer step and divides each micro-batch's
numerator by it.

Every policy loss in `POLICY_LOSSES` (registry.py) has the same signature

    fn(logp [B,T], old_logp [B,T], advantages [B] or [B,T], mask [B,T], cfg) -> (token_loss [B,T], info)

token_loss is 0 (with 0 gradient) wherever mask is 0, whatever logp holds there. info always has
the same keys, all [B,T] and detached: "ratio" (float; the sequence ratio for gspo) and the bool
masks "clip_low", "clip_high", "dual_clip" (already ANDed with mask: sum them for counts).
"""

from __future__ import annotations

import typing
from typing import Optional

import torch

from distflow.config import AlgorithmConfig
from distflow.config.algorithm import LossAggMode

LOSS_AGG_MODES = typing.get_args(LossAggMode)

MAX_LOG_RATIO = 20.0  # |log ratio| clamp before exp, as verl: keeps exp finite in fp32


def _adv2d(advantages: torch.Tensor) -> torch.Tensor:
    return advantages if advantages.dim() == 2 else advantages[:, None]


def _masked_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamped logp - old_logp on valid tokens, exactly 0 (no gradient) on padding; plus the bool mask."""
    m = mask.bool()
    diff = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.where(m, diff, torch.zeros_like(diff)), m


def _info(ratio: torch.Tensor, m: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
          dual: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    return {
        "ratio": ratio.detach(),
        "clip_low": (low & m).detach(),
        "clip_high": (high & m).detach(),
        "dual_clip": (dual & m).detach() if dual is not None else torch.zeros_like(m),
    }


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip (Schulman 2017), asymmetric eps (DAPO clip-higher), optional dual-clip (Ye et al. 2020).

    loss = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); for A < 0 with dual_clip_c = c it is
    further capped at -c A (verl's compute_policy_loss), so huge ratios on bad tokens stop pushing.
    """
    log_ratio, m = _masked_log_ratio(logp, old_logp, mask)
    ratio, adv = torch.exp(log_ratio), _adv2d(advantages)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    dual = None
    if cfg.dual_clip_c is not None:
        bound = -adv * cfg.dual_clip_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    return loss, _info(ratio, m, (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0), dual)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025), GSPO-token form: clip the sequence ratio s_i = exp(mean_t(logp - old)).

    Per token the ratio is sg(s_i) * exp(logp - sg(logp)): its value is s_i, its gradient s_i * grad logp.
    Exactly the paper's objective with loss_agg_mode=seq-mean-token-mean. log s is capped at 10 (verl).
    """
    log_ratio, m = _masked_log_ratio(logp, old_logp, mask)
    fm = m.to(log_ratio.dtype)
    log_seq = (log_ratio * fm).sum(-1) / fm.sum(-1).clamp(min=1)
    lp = torch.where(m, logp, torch.zeros_like(logp))
    ratio = torch.exp((lp - lp.detach() + log_seq.detach()[:, None]).clamp(max=10.0))
    adv = _adv2d(advantages)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    loss = torch.where(m, loss, torch.zeros_like(loss))
    return loss, _info(ratio, m, (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0))


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(min(r, 1+eps_high)) * A * logp; every token keeps a gradient.

    Only the upper bound is used, as in the paper ("no lower bound ... only tuned eps_high"), so
    clip_eps_low is ignored. The loss VALUE is not a surrogate (it scales with logp); its gradient is
    -min(r, 1+eps_high) * A * grad logp. info: clip_high = weight capped (either sign of A).
    """
    log_ratio, m = _masked_log_ratio(logp, old_logp, mask)
    ratio, adv = torch.exp(log_ratio), _adv2d(advantages)
    hi = 1.0 + cfg.clip_eps_high
    weight = ratio.clamp(max=hi).detach()
    lp = torch.where(m, logp, torch.zeros_like(logp))
    loss = torch.where(m, -weight * adv * lp, torch.zeros_like(lp))
    return loss, _info(ratio, m, torch.zeros_like(m), ratio > hi)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: Optional[float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, per token: 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2).

    The clipped term keeps one update from moving a value far from its rollout-time estimate
    (as in verl and OpenAI baselines); clip=None is the plain squared error. 0 on padding.
    info: "clipped" (bool, the clipped term was the larger one) and "error" (v - R), detached.
    """
    m = mask.bool()
    err = (values - returns) ** 2
    if clip is not None:
        clipped_v = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped_v - returns) ** 2
        loss, hit = torch.maximum(err, err_clipped), (err_clipped > err) & m
    else:
        loss, hit = err, torch.zeros_like(m)
    loss = torch.where(m, 0.5 * loss, torch.zeros_like(loss))
    return loss, {"clipped": hit.detach(), "error": torch.where(m, values - returns, 0.0).detach()}


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
