"""The policy-gradient pass over one mini-batch: forward, loss, backward. No optimizer step.

Sharding-invariance lives here. The loss normaliser (token or sequence count) is summed over
all ranks, each micro-batch's loss is divided by it and multiplied by the world size (FSDP
averages gradients over ranks), and every rank runs the same number of forward/backward
passes, padding with zero-weight passes if its share is smaller. The resulting gradient is
the one a single process would get on the whole global mini-batch.
"""

from __future__ import annotations

import torch

from distflow.algorithms import aggregate_denominator, aggregate_numerator, clipped_surrogate
from distflow.config import DistflowConfig
from distflow.distributed import all_reduce
from distflow.policy import Policy, TokenBatch
from distflow.rollout.base import Sample


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        n = min(width, r.shape[0])
        out[i, :n] = r[:n]
    return out


def backward_policy_loss(
    policy: Policy,
    samples: list[Sample],
    advantages: torch.Tensor,
    old_logprobs: list[torch.Tensor] | None,
    cfg: DistflowConfig,
    pad_id: int,
) -> dict[str, float]:
    """Accumulate gradients of the global mini-batch loss; returns this rank's metric sums.

    `old_logprobs` (one row per sample) is None when the sampling policy is the current one:
    then the detached current logprobs are used and the ratio is exactly 1.
    """
    a, device, world = cfg.algorithm, policy.device, torch.distributed.get_world_size()
    size = cfg.optim.micro_batch_size
    micro = [(i, TokenBatch.from_samples(samples[i : i + size], pad_id, device)) for i in range(0, len(samples), size)]
    denom = float(all_reduce(sum(aggregate_denominator(mb.resp_mask, a.loss_agg_mode) for _, mb in micro)))
    denom = max(denom, 1.0)
    n_passes = int(all_reduce(len(micro), "max"))
    stats = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "tokens": 0.0}
    for k in range(n_passes):
        real = k < len(micro)
        start, mb = micro[k] if real else micro[0]
        adv = advantages[start : start + mb.input_ids.shape[0]].to(device)
        logp = policy.logprobs(mb, cfg.rollout.temperature)
        old = logp.detach() if old_logprobs is None else _pad_rows(old_logprobs[start : start + len(adv)], logp.shape[1])
        token_loss, info = clipped_surrogate(logp, old, adv, a.clip_eps_low, a.clip_eps_high)
        num = aggregate_numerator(token_loss, mb.resp_mask, a.loss_agg_mode, cfg.rollout.max_new_tokens)
        weight = world / denom if real else 0.0  # padding passes contribute nothing
        (num * weight).backward()
        if real:
            mask = mb.resp_mask.bool()
            stats["loss"] += float(num.detach()) / denom
            stats["clip_low"] += float(info["clip_low"][mask].sum())
            stats["clip_high"] += float(info["clip_high"][mask].sum())
            stats["tokens"] += float(mask.sum())
    return stats
