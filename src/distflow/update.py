"""Forward passes over a rank's samples, and the policy-gradient pass over one mini-batch.

Sharding-invariance lives here. Every rank runs the same number of FSDP forward (and
backward) passes — the count is agreed with an all_reduce(MAX) and short ranks pad with
zero-weight passes, even a rank that has no samples at all (dynamic sampling can leave one
empty). The loss normaliser (token or sequence count) is summed over all ranks; each
micro-batch's loss is divided by it and multiplied by the world size (FSDP averages
gradients over ranks), which yields the gradient a single process would get on the whole
global mini-batch.
"""

from __future__ import annotations

from typing import Iterator

import torch

from distflow.algorithms import aggregate_denominator, aggregate_numerator, compute_token_loss
from distflow.config import DistflowConfig
from distflow.distributed import all_reduce
from distflow.policy import Policy, TokenBatch
from distflow.rollout.base import Sample


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D per-sample tensors into [len(rows), width], zero-padded or cut."""
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        n = min(width, r.shape[0])
        out[i, :n] = r[:n]
    return out


def micro_batches(samples: list[Sample], size: int, pad_id: int, device: torch.device,
                  drop_truncated: bool = False) -> Iterator[tuple[int, TokenBatch, bool]]:
    """(start index, batch, real) for this rank, padded to the global number of passes.

    Padding passes reuse the first micro-batch (or a one-token dummy on an empty rank) and
    must contribute nothing: callers weight them by 0 and drop their outputs.
    """
    n_real = (len(samples) + size - 1) // size
    n_passes = int(all_reduce(n_real, "max"))
    dummy = [Sample([pad_id], [pad_id], [0.0], False)]
    for k in range(n_passes):
        real = k < n_real
        start = k * size if real else 0
        chunk = samples[start : start + size] if real else (samples[:size] or dummy)
        yield start, TokenBatch.from_samples(chunk, pad_id, device, drop_truncated), real


@torch.no_grad()
def per_sample_logprobs(policy: Policy, samples: list[Sample], cfg: DistflowConfig, pad_id: int) -> list[torch.Tensor]:
    """Response logprobs of every sample (one 1-D tensor each), in as many passes as any rank."""
    out: list[torch.Tensor] = []
    for _, mb, real in micro_batches(samples, cfg.optim.micro_batch_size, pad_id, policy.device):
        lp = policy.logprobs(mb, cfg.rollout.temperature)
        if real:
            lengths = mb.resp_mask.sum(-1).long().tolist()
            out += [lp[i, :n] for i, n in enumerate(lengths)]
    return out


def backward_policy_loss(
    policy: Policy,
    samples: list[Sample],
    advantages: torch.Tensor,
    old_logprobs: list[torch.Tensor] | None,
    cfg: DistflowConfig,
    pad_id: int,
    ref_logprobs: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Accumulate gradients of the global mini-batch loss; returns this rank's metric sums.

    `old_logprobs` (one row per sample) is None when the sampling policy is the current one:
    then the detached current logprobs are used and the ratio is exactly 1.
    """
    a, device, world = cfg.algorithm, policy.device, torch.distributed.get_world_size()
    batches = list(micro_batches(samples, cfg.optim.micro_batch_size, pad_id, device, a.overlong_filter))
    local_den = sum(aggregate_denominator(mb.resp_mask, a.loss_agg_mode) for _, mb, real in batches if real)
    denom = max(float(all_reduce(local_den)), 1.0)
    stats = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "dual_clip": 0.0, "tokens": 0.0,
             "kl": 0.0, "entropy": 0.0, "tis_weight": 0.0}
    for start, mb, real in batches:
        rows = slice(start, start + mb.input_ids.shape[0])
        adv = advantages[rows].to(device) if real else torch.zeros(mb.input_ids.shape[0], device=device)
        logp, entropy = policy.forward(mb, cfg.rollout.temperature, with_entropy=a.entropy_coef != 0)
        width = logp.shape[1]
        old = logp.detach() if old_logprobs is None or not real else pad_rows(old_logprobs[rows], width)
        engine = None
        if a.tis_cap is not None:
            engine = pad_rows([torch.tensor(s.logprobs, device=device) for s in samples[rows]], width) if real else old
        ref = pad_rows(ref_logprobs[rows], width) if (ref_logprobs is not None and real) else (old if a.kl_coef > 0 else None)
        token_loss, info = compute_token_loss(logp, old, adv, mb.resp_mask, a,
                                              engine_logp=engine, ref_logp=ref, entropy=entropy)
        num = aggregate_numerator(token_loss, mb.resp_mask, a.loss_agg_mode, cfg.rollout.max_new_tokens)
        (num * (world / denom if real else 0.0)).backward()  # padding passes contribute nothing
        if real:
            mask = mb.resp_mask.bool()
            stats["loss"] += float(num.detach()) / denom
            stats["tokens"] += float(mask.sum())
            for key in ("clip_low", "clip_high", "dual_clip", "kl", "entropy", "tis_weight"):
                if key in info:
                    stats[key] += float(info[key].float()[mask].sum())
    return stats
