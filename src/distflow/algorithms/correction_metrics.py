"""The rollout correction's per-step statistics, as one float64 vector per rank: the update adds
micro-batches' vectors on the device (sums add, the maximum combines by max), the report sums
ranks and turns the totals into the rollout_corr/* metrics. Measured on every trained token,
whatever the correction is set to (with it off: what it would see).

    rho_mean, rho_max       the per-token ratio pi_old / mu (clamped as the correction clamps it)
    rho_p99                 its 99th percentile, from a histogram of log rho summed over ranks (20
                            bins per decade of |log rho| from 1e-5 to 20): the upper edge of the bin
                            that holds it, so within 12% of the exact log ratio (0.4% in rho near 1),
                            and exactly 1 when it falls in [1, exp(1e-5))
    seq_log_ratio_mean      the mean over sequences of sum_t log rho_t
    tokens_masked_frac      trained tokens a rejection (or the veto) zeroed
    seqs_masked_frac        sequences a sequence-level rejection (or the veto) zeroed
    tokens_clipped_frac     tokens whose importance weight was truncated at the cap
    weight_mean, ess        the final weight's mean over trained tokens, and its normalised effective
                            sample size (sum w)^2 / (n sum w^2), 1 when every weight is equal
    len_q{1..4}/...         the mask fractions, rho mean and sequence log ratio by response length:
                            quarter k holds sequences with (k-1)/4 <= trained tokens / budget < k/4
                            (the last also those at the budget)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from distflow.algorithms.rollout_correction import Correction

_POS = [10.0 ** (j / 20 - 5) for j in range(127)]  # 1e-5 ... 20
LOG_EDGES = [-e for e in reversed(_POS)] + [0.0] + _POS  # upper edges of the bins of log rho
HEAD = ("tokens", "seqs", "rho_sum", "rho_max", "seq_log_ratio_sum", "tokens_masked", "seqs_masked",
        "tokens_clipped", "weight_sum", "weight_sq_sum")
BUCKETS = 4
PER_BUCKET = ("seqs", "tokens", "seqs_masked", "tokens_masked", "rho_sum", "seq_log_ratio_sum")
RHO_MAX = HEAD.index("rho_max")  # the entry that combines by max; the others add
SIZE = len(HEAD) + len(LOG_EDGES) + 1 + BUCKETS * len(PER_BUCKET)


@torch.no_grad()
def correction_vector(c: Correction, mask: torch.Tensor, budget: int) -> torch.Tensor:
    """This micro-batch's sums (see the module doc), float64, on the mask's device."""
    m = mask.bool()
    n_tok = m.sum(-1)
    has = n_tok > 0
    rho = torch.exp(c.log_rho)
    seq_log = torch.where(m, c.log_rho, torch.zeros_like(c.log_rho)).sum(-1)
    masked_tok = m & ~c.kept
    masked_seq = has & ~c.seq_kept
    w = c.weight[m].double()
    head = torch.stack([
        m.sum().double(), has.sum().double(), rho[m].double().sum(),
        rho[m].double().max() if bool(m.any()) else torch.zeros((), dtype=torch.float64, device=m.device),
        seq_log[has].double().sum(), masked_tok.sum().double(), masked_seq.sum().double(),
        c.clipped.sum().double(), w.sum(), (w * w).sum()])
    edges = torch.tensor(LOG_EDGES, dtype=c.log_rho.dtype, device=m.device)
    hist = torch.bincount(torch.bucketize(c.log_rho[m], edges, right=True), minlength=len(LOG_EDGES) + 1)
    bucket = torch.clamp(n_tok * BUCKETS // max(budget, 1), max=BUCKETS - 1)
    rows = torch.stack([has.double(), n_tok.double(), masked_seq.double(), masked_tok.sum(-1).double(),
                        torch.where(m, rho, torch.zeros_like(rho)).sum(-1).double(), seq_log.double()], dim=1)
    per = torch.zeros((BUCKETS, len(PER_BUCKET)), dtype=torch.float64, device=m.device)
    per.index_add_(0, bucket[has], rows[has])
    return torch.cat([head, hist.double(), per.flatten()])


def empty_vector(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(SIZE, dtype=torch.float64, device=device)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two correction vectors as one: sums add, rho_max is the larger."""
    out = a + b
    out[RHO_MAX] = torch.maximum(a[RHO_MAX], b[RHO_MAX])
    return out


@dataclass
class CorrectionSums:
    """A rank's correction vector on the host (zeros: nothing measured)."""

    values: list[float] = field(default_factory=lambda: [0.0] * SIZE)

    def __add__(self, other: "CorrectionSums") -> "CorrectionSums":
        out = [a + b for a, b in zip(self.values, other.values)]
        out[RHO_MAX] = max(self.values[RHO_MAX], other.values[RHO_MAX])
        return CorrectionSums(out)


def log_percentile(hist: list[float], q: float) -> float:
    """The upper edge of the LOG_EDGES bin that holds the q-quantile (the clamp bound for the open
    last bin); 0 for an empty histogram."""
    total = sum(hist)
    if total <= 0:
        return 0.0
    running = 0.0
    for k, count in enumerate(hist):
        running += count
        if running >= q * total:
            if k and LOG_EDGES[k - 1] == 0.0:  # [0, 1e-5): below the resolution, reported as exactly 0
                return 0.0
            return LOG_EDGES[k] if k < len(LOG_EDGES) else 20.0
    return 20.0


def correction_metrics(values: list[float]) -> dict[str, float]:
    """The rollout_corr/* metrics from a vector summed over ranks (rho_max combined by max)."""
    head = dict(zip(HEAD, values[:len(HEAD)]))
    hist = values[len(HEAD):len(HEAD) + len(LOG_EDGES) + 1]
    per = values[len(HEAD) + len(LOG_EDGES) + 1:]
    tokens, seqs = max(head["tokens"], 1.0), max(head["seqs"], 1.0)
    out = {
        "rollout_corr/rho_mean": head["rho_sum"] / tokens if head["tokens"] else 1.0,
        "rollout_corr/rho_p99": math.exp(log_percentile(hist, 0.99)),
        "rollout_corr/rho_max": head["rho_max"] if head["tokens"] else 1.0,
        "rollout_corr/seq_log_ratio_mean": head["seq_log_ratio_sum"] / seqs,
        "rollout_corr/tokens_masked_frac": head["tokens_masked"] / tokens,
        "rollout_corr/seqs_masked_frac": head["seqs_masked"] / seqs,
        "rollout_corr/tokens_clipped_frac": head["tokens_clipped"] / tokens,
        "rollout_corr/weight_mean": head["weight_sum"] / tokens if head["tokens"] else 1.0,
        "rollout_corr/ess": head["weight_sum"] ** 2 / (tokens * head["weight_sq_sum"]) if head["weight_sq_sum"] else 1.0,
    }
    for k in range(BUCKETS):
        b = dict(zip(PER_BUCKET, per[k * len(PER_BUCKET):(k + 1) * len(PER_BUCKET)]))
        s, t = max(b["seqs"], 1.0), max(b["tokens"], 1.0)
        out.update({f"rollout_corr/len_q{k + 1}/seqs": b["seqs"],
                    f"rollout_corr/len_q{k + 1}/seqs_masked_frac": b["seqs_masked"] / s,
                    f"rollout_corr/len_q{k + 1}/tokens_masked_frac": b["tokens_masked"] / t,
                    f"rollout_corr/len_q{k + 1}/rho_mean": b["rho_sum"] / t if b["tokens"] else 1.0,
                    f"rollout_corr/len_q{k + 1}/seq_log_ratio_mean": b["seq_log_ratio_sum"] / s})
    return out
