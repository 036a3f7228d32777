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
    lag{0..3}/...           by version lag (how many policy versions older than the engine's at the
                            step the token's generating policy was; lag3 also counts older ones): the
                            tokens, their masked fraction, the final weight's mean and max and the
                            ESS; reported for the lags that hold tokens (carried-over tokens lag)
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
LAGS = 4
PER_LAG = ("tokens", "tokens_masked", "weight_sum", "weight_sq_sum", "weight_max")
RHO_MAX = HEAD.index("rho_max")
_LAG_AT = len(HEAD) + len(LOG_EDGES) + 1 + BUCKETS * len(PER_BUCKET)
SIZE = _LAG_AT + LAGS * len(PER_LAG)
# the entries that combine by max; the others add
MAXIMA = (RHO_MAX, *(_LAG_AT + k * len(PER_LAG) + PER_LAG.index("weight_max") for k in range(LAGS)))


@torch.no_grad()
def correction_vector(c: Correction, mask: torch.Tensor, budget: int, lag: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's sums (see the module doc), float64, on the mask's device; `lag` [B, T]:
    each token's version lag (None: all 0)."""
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
    return torch.cat([head, hist.double(), per.flatten(), _by_lag(lag, m, masked_tok, w)])


def _by_lag(lag: torch.Tensor | None, m: torch.Tensor, masked: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[LAGS * len(PER_LAG)]: the trained tokens' counts, masked counts and weight sums and maxima by lag."""
    k = torch.zeros_like(w, dtype=torch.long) if lag is None else lag[m].long().clamp(0, LAGS - 1)
    per = torch.zeros((LAGS, len(PER_LAG)), dtype=torch.float64, device=m.device)
    per[:, 0] = torch.bincount(k, minlength=LAGS).double()
    per[:, 1] = torch.bincount(k, weights=masked[m].double(), minlength=LAGS)
    per[:, 2].index_add_(0, k, w)
    per[:, 3].index_add_(0, k, w * w)
    per[:, 4] = per[:, 4].scatter_reduce(0, k, w, "amax")  # weights are >= 0: the zeros never win wrongly
    return per.flatten()


def empty_vector(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(SIZE, dtype=torch.float64, device=device)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two correction vectors as one: sums add, the maxima are the larger."""
    out = a + b
    idx = torch.tensor(MAXIMA, device=a.device)
    out[idx] = torch.maximum(a[idx], b[idx])
    return out


@dataclass
class CorrectionSums:
    """A rank's correction vector on the host (zeros: nothing measured)."""

    values: list[float] = field(default_factory=lambda: [0.0] * SIZE)

    def __add__(self, other: "CorrectionSums") -> "CorrectionSums":
        out = [a + b for a, b in zip(self.values, other.values)]
        for i in MAXIMA:
            out[i] = max(self.values[i], other.values[i])
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
    """The rollout_corr/* metrics from a vector summed over ranks (the MAXIMA combined by max)."""
    head = dict(zip(HEAD, values[:len(HEAD)]))
    hist = values[len(HEAD):len(HEAD) + len(LOG_EDGES) + 1]
    per = values[len(HEAD) + len(LOG_EDGES) + 1:_LAG_AT]
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
    for k in range(LAGS):
        b = dict(zip(PER_LAG, values[_LAG_AT + k * len(PER_LAG):_LAG_AT + (k + 1) * len(PER_LAG)]))
        if b["tokens"]:
            out.update({f"rollout_corr/lag{k}/tokens": b["tokens"],
                        f"rollout_corr/lag{k}/tokens_masked_frac": b["tokens_masked"] / b["tokens"],
                        f"rollout_corr/lag{k}/weight_mean": b["weight_sum"] / b["tokens"],
                        f"rollout_corr/lag{k}/weight_max": b["weight_max"],
                        f"rollout_corr/lag{k}/ess": b["weight_sum"] ** 2 / (b["tokens"] * b["weight_sq_sum"])
                        if b["weight_sq_sum"] else 1.0})
    return out
