"""On-policy distillation (Agarwal et al. 2024, GKD; Qwen3's and Thinking Machines' reports): the
student samples, a frozen teacher scores every sampled token, and each token's advantage is the
negative per-token reverse KL, -(log pi_student - log pi_teacher), with no discount: a token the
teacher finds likelier than the student is pushed up, one it finds unlikely is pushed down. The
sampled tokens come from the student, so the mean of log pi_student - log pi_teacher over them is
an unbiased estimate of KL(pi_student || pi_teacher), the quantity being minimised.

The student's logprobs are the trainer's (the policy at the weights that sampled), not the
engine's, so a teacher identical to the student gives exactly zero advantage on every token.

    reverse_kl_mean   mean over trained tokens of log pi_student - log pi_teacher
    reverse_kl_p99    its 99th percentile, from a histogram summed over ranks (the log-ratio bins
                      of distflow.algorithms.correction_metrics: within 12%, exactly 0 below 1e-5)
    reverse_kl_max    the largest per-token value
"""

from __future__ import annotations

import torch

from distflow.algorithms.advantages import AdvantageInputs, GlobalSum, grpo_advantages
from distflow.algorithms.correction_metrics import LOG_EDGES, log_percentile
from distflow.config import AlgorithmConfig

HEAD = ("sum", "tokens", "max")
MAX = HEAD.index("max")  # the entry that combines by max; the others add
SIZE = len(HEAD) + len(LOG_EDGES) + 1


def distill_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig,
                       global_sum: GlobalSum) -> tuple[torch.Tensor, None]:
    """[N, R] advantages: -(log pi_student - log pi_teacher) on each response token, plus
    cfg.distill_reward_weight times the GRPO advantage of the sample's reward (outcome plus token
    rewards), spread over its tokens. No returns (no critic)."""
    if inputs.teacher_log_ratio is None:
        raise ValueError("distill needs the teacher's logprobs (AdvantageInputs.teacher_log_ratio)")
    m = inputs.mask.to(torch.float32)
    adv = -inputs.teacher_log_ratio.to(torch.float32) * m
    if cfg.distill_reward_weight:
        task = inputs.per_row(grpo_advantages(inputs.sequence_rewards().view(-1, cfg.group_size), cfg,
                                              global_sum).reshape(-1))
        adv = adv + cfg.distill_reward_weight * task[:, None].to(m.device) * m
    return adv, None


@torch.no_grad()
def distill_vector(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's sums over the tokens where `mask` is set, float64 on their device: the sum of
    log pi_student - log pi_teacher, the token count, the largest value (-inf without tokens),
    then the histogram's counts."""
    m = mask.bool()
    x = log_ratio.float()[m]
    top = x.max().double() if x.numel() else torch.tensor(float("-inf"), dtype=torch.float64, device=m.device)
    edges = torch.tensor(LOG_EDGES, dtype=x.dtype, device=m.device)
    hist = torch.bincount(torch.bucketize(x, edges, right=True), minlength=len(LOG_EDGES) + 1)
    head = torch.stack([x.double().sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=m.device), top])
    return torch.cat([head, hist.double()])


def no_sums() -> list[float]:
    """The sums of a rank that measured no tokens (what distill_vector gives for an empty mask)."""
    return [0.0, 0.0, float("-inf")] + [0.0] * (SIZE - len(HEAD))


def distill_metrics(values: list[float]) -> dict[str, float]:
    """The distill/* metrics from a vector summed over ranks (its max combined by max)."""
    total, tokens, top = values[:len(HEAD)]
    return {"distill/reverse_kl_mean": total / tokens if tokens else 0.0,
            "distill/reverse_kl_p99": log_percentile(list(values[len(HEAD):]), 0.99),
            "distill/reverse_kl_max": top if tokens else 0.0}
