"""Rollout correction: importance weights and rejection masks for tokens that the engine's
distribution mu sampled and the policy trains on (verl's rollout_corr, TRL's vLLM importance
sampling, IcePop). Each piece is a small pure function of [B, T] tensors; `rollout_correction`
composes them as the config asks, and the result's `weight` multiplies the policy's token loss.

    log rho_t = clamp(log pi_old(a_t) - log mu(a_t), -20, 20)        0 on padding
    token IS      w_t = min(rho_t, C)
    sequence IS   w   = min(exp(clamp(sum_t log rho_t, -20, 20)), C)  for every token of the sequence
    token RS      keep t   iff  lower <= rho_t <= upper                (IcePop)
    sequence RS   keep seq iff  lower <= exp(clamp(sum_t log rho_t)) <= upper   (masked IS)
    geometric RS  keep seq iff  lower <= exp(mean_t log rho_t) <= upper         (Geo-RS)
    k3 RS         keep seq iff  mean_t (rho_t - log rho_t - 1) <= tau
    veto          keep seq iff  no token has rho_t < v (the ratio before the clamp)

A sequence with no trained token has sum 0 and mean 0 (ratio 1): it is kept, and its weights
are 1, so an empty response or an all-masked micro-batch gives exact zeros, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distflow.config.rollout_correction import RolloutCorrectionConfig

LOG_RATIO_BOUND = 20.0  # every log ratio is clamped to [-20, 20] before exp, as verl


def raw_log_ratio(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_old - log mu per token, unclamped; 0 on padding."""
    diff = proximal.detach().float() - behaviour.detach().float()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def clamp_log(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def token_counts(mask: torch.Tensor) -> torch.Tensor:
    """[B] trained tokens per sequence, as float."""
    return mask.bool().sum(-1).to(torch.float32)


def sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] clamp(sum_t log rho_t): the log of the sequence's likelihood ratio."""
    return clamp_log(torch.where(mask.bool(), log_rho, torch.zeros_like(log_rho)).sum(-1))


def geometric_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean_t log rho_t (0 for a sequence with no trained token)."""
    return torch.where(mask.bool(), log_rho, torch.zeros_like(log_rho)).sum(-1) / token_counts(mask).clamp(min=1)


def token_is_weight(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """[B, T] min(rho_t, cap)."""
    return torch.exp(log_rho).clamp(max=cap)


def sequence_is_weight(log_rho: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """[B] min(prod_t rho_t, cap)."""
    return torch.exp(sequence_log_ratio(log_rho, mask)).clamp(max=cap)


def in_band(ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    return (ratio >= lower) & (ratio <= upper)


def token_keep(log_rho: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """[B, T] IcePop's token mask: rho_t inside [lower, upper]."""
    return in_band(torch.exp(log_rho), lower, upper)


def sequence_keep(log_rho: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """[B] masked IS: the sequence ratio inside [lower, upper]."""
    return in_band(torch.exp(sequence_log_ratio(log_rho, mask)), lower, upper)


def geometric_keep(log_rho: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """[B] Geo-RS: the geometric mean of the token ratios inside [lower, upper]."""
    return in_band(torch.exp(geometric_log_ratio(log_rho, mask)), lower, upper)


def k3_keep(log_rho: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """[B] the sequence's mean k3 estimate of KL(mu || pi_old), rho - log rho - 1, at most tau."""
    m = mask.bool()
    k3 = torch.where(m, torch.exp(log_rho) - log_rho - 1, torch.zeros_like(log_rho))
    return k3.sum(-1) / token_counts(mask).clamp(min=1) <= tau


def veto_keep(raw: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B] no trained token with rho_t < threshold, on the unclamped ratio."""
    low = (torch.exp(raw) < threshold) & mask.bool()
    return ~low.any(-1)


@dataclass(frozen=True)
class Correction:
    """What the correction did to one micro-batch, all detached.

    weight   [B, T] the factor on the policy's token loss: importance weight times the masks (1 on padding)
    log_rho  [B, T] clamped log ratio (0 on padding), for the metrics
    kept     [B, T] bool: the token survived every rejection (True on padding)
    seq_kept [B] bool: the sequence survived the sequence-level rejections and the veto
    clipped  [B, T] bool: the token's importance weight was truncated at the cap
    """

    weight: torch.Tensor
    log_rho: torch.Tensor
    kept: torch.Tensor
    seq_kept: torch.Tensor
    clipped: torch.Tensor


def importance_weight(log_rho: torch.Tensor, mask: torch.Tensor,
                      cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] truncated weights, [B, T] bool truncated) of cfg.rollout_is; ones when it is off."""
    if cfg.rollout_is == "token":
        return token_is_weight(log_rho, cfg.rollout_is_threshold), torch.exp(log_rho) > cfg.rollout_is_threshold
    if cfg.rollout_is == "sequence":
        ratio = torch.exp(sequence_log_ratio(log_rho, mask))[:, None].expand_as(log_rho)
        return ratio.clamp(max=cfg.rollout_is_threshold), ratio > cfg.rollout_is_threshold
    return torch.ones_like(log_rho), torch.zeros_like(log_rho, dtype=torch.bool)


def rejection(log_rho: torch.Tensor, mask: torch.Tensor,
              cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] token keep, [B] sequence keep) of cfg.rollout_rs (all True when it is off)."""
    tokens = torch.ones_like(log_rho, dtype=torch.bool)
    seqs = torch.ones(log_rho.shape[0], dtype=torch.bool, device=log_rho.device)
    lower, upper = cfg.band() if cfg.rollout_rs is not None else (0.0, 0.0)
    if cfg.rollout_rs == "token":
        tokens = token_keep(log_rho, lower, upper) | ~mask.bool()
    elif cfg.rollout_rs == "sequence":
        seqs = sequence_keep(log_rho, mask, lower, upper)
    elif cfg.rollout_rs == "geometric":
        seqs = geometric_keep(log_rho, mask, lower, upper)
    elif cfg.rollout_rs == "k3":
        seqs = k3_keep(log_rho, mask, upper)
    return tokens, seqs


def rollout_correction(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig, weight_scale: float = 1.0) -> Correction:
    """The correction of one micro-batch: `proximal` is log pi_old (decoupled) or the current policy's
    detached logprobs (bypass), `behaviour` the engine's; `weight_scale` is the batch
    normalisation's 1 / mean weight (1 without it)."""
    raw = raw_log_ratio(proximal, behaviour, mask)
    log_rho = clamp_log(raw)
    w, clipped = importance_weight(log_rho, mask, cfg)
    tokens, seqs = rejection(log_rho, mask, cfg)
    if cfg.rollout_token_veto_threshold is not None:
        seqs = seqs & veto_keep(raw, mask, cfg.rollout_token_veto_threshold)
    m = mask.bool()
    kept = (tokens & seqs[:, None]) | ~m
    weight = torch.where(m, w * weight_scale * kept, torch.ones_like(w))
    return Correction(weight, log_rho, kept, seqs, clipped & m)


def importance_weight_sums(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                           cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the truncated weights, how many) over this rank's batch, for the batch normalisation:
    every trained token for token weights, every sequence with a trained token for sequence weights."""
    log_rho, m = clamp_log(raw_log_ratio(proximal, behaviour, mask)), mask.bool()
    if cfg.rollout_is == "sequence":
        has = m.any(-1)
        return sequence_is_weight(log_rho, mask, cfg.rollout_is_threshold)[has].double().sum(), has.double().sum()
    return token_is_weight(log_rho, cfg.rollout_is_threshold)[m].double().sum(), m.double().sum()
