"""KL-to-reference estimators (Schulman, "Approximating KL divergence", 2020) and token entropy.

All are per token, [B, T], for tokens sampled from the current (or old) policy:
    k1 = logp - ref                         unbiased, high variance, can be negative
    k2 = 0.5 * (logp - ref)^2               biased, low variance; its gradient is the one of the true KL
    k3 = exp(ref - logp) - (ref - logp) - 1 unbiased, low variance, >= 0 ("low_var_kl" in verl)
Padding positions are the caller's to mask (aggregate with the response mask as for the policy loss).
"""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1: the naive log-ratio estimator."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2: half the squared log-ratio."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3: Schulman's low-variance unbiased estimator; log-ratio clamped to [-20, 20], result to [-10, 10] (verl)."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of the chosen kind (k1 | k2 | k3), [B, T]."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kind!r}; choose from {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Detached per-token KL, 0 on padding, [B, T]: for kl_in_reward with token-level rewards (PPO)."""
    with torch.no_grad():
        m = mask.bool()
        return kl_penalty(torch.where(m, logp, 0.0), torch.where(m, ref_logp, 0.0), kind) * m


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Detached per-sequence KL sum over valid tokens, [B]: for kl_in_reward (r <- r - kl_coef * this)."""
    return token_kl(logp, ref_logp, mask, kind).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, [B, T, V] -> [B, T] (logsumexp - E_p[logit], stable)."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)
