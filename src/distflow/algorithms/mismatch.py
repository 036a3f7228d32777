"""How far the engine's sampling distribution is from the policy being trained, measured on the
training batch itself: the engine's logprob of each sampled token against the policy's, at the
weights that sampled it (the update's own forward, or the old-logprob pass when there is one).

In float32 the two agree to ~1e-6; in bf16 they differ by design (different kernels, bf16
rounding of activations and logits), and this is the number that says by how much, every step,
at no extra forward. The max-over-tokens probe after a resync (distflow.probe)
stays the exactness check.

    abs_mean   mean |log pi_engine - log pi_policy| over trained tokens
    abs_p99    its 99th percentile, from a histogram summed over ranks (10 bins per decade from
               1e-7 to 10): the upper edge of the bin that holds the 99th percentile, so it is at
               most 26% above the exact value, and exact at 0 (a token with |diff| below 1e-7
               counts as 0)
    abs_max    the largest |diff| of any trained token
    kl         k3 estimate of KL(pi_engine || pi_policy) per token: the tokens were sampled from
               the engine, so k3(engine, policy) is unbiased for it (Schulman 2020)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distflow.algorithms.kl import kl_k3

# Upper bin edges of |diff|: bin 0 is [0, 1e-7), bin k is [E[k-1], E[k]), the last bin is [10, inf).
EDGES = [10.0 ** (k / 10 - 7) for k in range(81)]


def _zeros() -> list[float]:
    return [0.0] * (len(EDGES) + 1)


@dataclass
class MismatchSums:
    """Per-rank sums over trained tokens (summed over ranks before they become metrics)."""

    abs_sum: float = 0.0
    kl_sum: float = 0.0
    tokens: float = 0.0
    abs_max: float = 0.0
    hist: list[float] = field(default_factory=_zeros)

    def __add__(self, other: "MismatchSums") -> "MismatchSums":
        return MismatchSums(self.abs_sum + other.abs_sum, self.kl_sum + other.kl_sum, self.tokens + other.tokens,
                            max(self.abs_max, other.abs_max), [a + b for a, b in zip(self.hist, other.hist)])


    @classmethod
    def from_values(cls, values: list[float]) -> "MismatchSums":
        """From mismatch_vector's layout: abs_sum, kl_sum, tokens, abs_max, then the histogram."""
        return cls(values[0], values[1], values[2], values[3], list(values[4:]))


ABS_MAX = 3  # the entry of mismatch_vector that combines by max; the others add


@torch.no_grad()
def mismatch_vector(policy_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sums of the tokens where `mask` is set ([B, R] each), as one float64 vector on their
    device: abs_sum, kl_sum, tokens, abs_max, then the histogram's counts. Nothing is copied to
    the host, so an update can add these up over its passes and read them once."""
    m = mask.bool()
    pol, eng = policy_logp.detach().float()[m], engine_logp.float()[m]
    diff = (eng - pol).abs()
    if diff.numel() == 0:
        return torch.zeros(4 + len(EDGES) + 1, dtype=torch.float64, device=mask.device)
    edges = torch.tensor(EDGES, dtype=diff.dtype, device=diff.device)
    hist = torch.bincount(torch.bucketize(diff, edges, right=True), minlength=len(EDGES) + 1)
    head = torch.stack([diff.sum(), kl_k3(eng, pol).sum(), torch.tensor(float(diff.numel()), device=diff.device),
                        diff.max()])
    return torch.cat([head.double(), hist.double()])


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two mismatch vectors as one: sums add, abs_max is the larger."""
    out = a + b
    out[ABS_MAX] = torch.maximum(a[ABS_MAX], b[ABS_MAX])
    return out


def mismatch_sums(policy_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> MismatchSums:
    """MismatchSums of the tokens where `mask` is set ([B, R] each)."""
    return MismatchSums.from_values(mismatch_vector(policy_logp, engine_logp, mask).tolist())


def percentile(hist: list[float], q: float) -> float:
    """The upper edge of the bin that holds the q-quantile of a histogram over EDGES' bins (0 for
    bin 0, inf for the open last bin); 0 for an empty histogram."""
    total = sum(hist)
    if total <= 0:
        return 0.0
    running, target = 0.0, q * total
    for k, count in enumerate(hist):
        running += count
        if running >= target:
            return 0.0 if k == 0 else (EDGES[k] if k < len(EDGES) else float("inf"))
    return float("inf")
