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

from typing import Callable, Iterator

import torch

from distflow.algorithms import aggregate_denominator, aggregate_numerator, compute_token_loss, value_loss
from distflow.config import DistflowConfig
from distflow.critic import Critic
from distflow.distributed import all_reduce
from distflow.policy import Policy, TokenBatch
from distflow.rollout.base import Sample


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D per-sample tensors into [len(rows), width], zero-padded or cut ([0, width] float
    when there are none: a rank may hold no samples)."""
    if not rows:
        return torch.zeros((0, width))
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        n = min(width, r.shape[0])
        out[i, :n] = r[:n]
    return out


def plan_micro_batches(lengths: list[int], size: int, token_budget: int = 0) -> list[list[int]]:
    """Sample indices of each micro-batch, sequences of similar length together.

    Sequences are ordered by length, so a micro-batch pads to a near neighbour instead of the
    longest sequence of the rank. With token_budget > 0 a micro-batch grows while its padded
    size (count x longest) stays within the budget (one longer sequence still gets its own);
    otherwise it holds `size` sequences. The loss does not depend on the split (global normaliser).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if token_budget <= 0:
        return [order[k : k + size] for k in range(0, len(order), size)]
    plan: list[list[int]] = []
    for i in order:
        if plan and (len(plan[-1]) + 1) * lengths[i] <= token_budget:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


def micro_batches(samples: list[Sample], cfg: DistflowConfig, pad_id: int, device: torch.device,
                  drop_truncated: bool = False) -> Iterator[tuple[list[int], TokenBatch, bool]]:
    """(sample indices, batch, real) for this rank, padded to the global number of passes.

    Padding passes reuse the first micro-batch (or a one-token dummy on an empty rank) and
    must contribute nothing: callers weight them by 0 and drop their outputs.
    """
    o = cfg.optim
    plan = plan_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], o.micro_batch_size,
                              o.micro_batch_tokens)
    n_passes = int(all_reduce(len(plan), "max"))
    dummy = [Sample([pad_id], [pad_id], [0.0], False)]
    for k in range(n_passes):
        real = k < len(plan)
        idx = plan[k] if real else (plan[0] if plan else [])
        chunk = [samples[i] for i in idx] or dummy
        yield idx, TokenBatch.from_samples(chunk, pad_id, device, drop_truncated), real


def pick(per_sample: list | None, idx: list[int]) -> list | None:
    return [per_sample[i] for i in idx] if per_sample is not None else None


@torch.no_grad()
def per_sample_rows(forward: Callable[[TokenBatch], torch.Tensor], samples: list[Sample], cfg: DistflowConfig,
                    pad_id: int, device: torch.device) -> list[torch.Tensor]:
    """forward(batch) -> [B, R] per response token, cut into one 1-D tensor per sample, in as
    many passes as any rank."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for idx, mb, real in micro_batches(samples, cfg, pad_id, device):
        rows = forward(mb)
        if real:
            for j, i in enumerate(idx):
                out[i] = rows[j, : len(samples[i].response_ids)]
    return out


def per_sample_logprobs(policy: Policy, samples: list[Sample], cfg: DistflowConfig, pad_id: int) -> list[torch.Tensor]:
    """Response logprobs of every sample at the rollout temperature."""
    return per_sample_rows(lambda mb: policy.logprobs(mb, cfg.rollout.temperature), samples, cfg, pad_id, policy.device)


def _global_denominator(batches: list[tuple[list[int], TokenBatch, bool]], mode: str) -> float:
    """The loss normaliser of the whole global mini-batch (summed over ranks), at least 1."""
    local = sum(aggregate_denominator(mb.resp_mask, mode) for _, mb, real in batches if real)
    return max(float(all_reduce(local)), 1.0)


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
    batches = list(micro_batches(samples, cfg, pad_id, device, a.overlong_filter))
    denom = _global_denominator(batches, a.loss_agg_mode)
    stats = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "dual_clip": 0.0, "tokens": 0.0,
             "kl": 0.0, "entropy": 0.0, "tis_weight": 0.0}
    for k, (idx, mb, real) in enumerate(batches):
        policy.all_reduce_gradients(k == len(batches) - 1)
        logp, entropy = policy.forward(mb, cfg.rollout.temperature, with_entropy=a.entropy_coef != 0)
        width = logp.shape[1]
        adv = advantages[idx].to(device) if real else torch.zeros(mb.input_ids.shape[0], device=device)
        if adv.dim() == 2:  # token-level (GAE): rows are left-aligned like the response mask
            adv = pad_rows(list(adv), width) if real else torch.zeros_like(logp)
        old = logp.detach() if old_logprobs is None or not real else pad_rows(pick(old_logprobs, idx), width)
        engine = None
        if a.tis_cap is not None:
            engine = pad_rows([torch.tensor(samples[i].logprobs, device=device) for i in idx], width) if real else old
        ref = (pad_rows(pick(ref_logprobs, idx), width) if (ref_logprobs is not None and real)
               else (old if a.kl_coef > 0 else None))
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


def backward_value_loss(critic: Critic, samples: list[Sample], old_values: list[torch.Tensor],
                        returns: list[torch.Tensor], cfg: DistflowConfig, pad_id: int) -> dict[str, float]:
    """The critic's counterpart of backward_policy_loss: clipped value loss, aggregated with the
    algorithm's loss_agg_mode over the global mini-batch, same passes on every rank."""
    a, device, world = cfg.algorithm, critic.device, torch.distributed.get_world_size()
    batches = list(micro_batches(samples, cfg, pad_id, device))
    denom = _global_denominator(batches, a.loss_agg_mode)
    stats = {"value_loss": 0.0, "value_clipped": 0.0, "value_sq_error": 0.0, "value_tokens": 0.0, "value_sum": 0.0}
    for k, (idx, mb, real) in enumerate(batches):
        critic.all_reduce_gradients(k == len(batches) - 1)
        values = critic.values(mb)
        width = values.shape[1]
        old = pad_rows(pick(old_values, idx), width).to(device) if real else values.detach()
        ret = pad_rows(pick(returns, idx), width).to(device) if real else values.detach()
        token_loss, info = value_loss(values, old, ret, mb.resp_mask, cfg.critic.value_clip)
        num = aggregate_numerator(token_loss, mb.resp_mask, a.loss_agg_mode, cfg.rollout.max_new_tokens)
        (num * (world / denom if real else 0.0)).backward()
        if real:
            mask = mb.resp_mask.bool()
            stats["value_loss"] += float(num.detach()) / denom
            stats["value_clipped"] += float(info["clipped"].sum())
            stats["value_sq_error"] += float((info["error"] ** 2).sum())
            stats["value_sum"] += float(values.detach()[mask].sum())
            stats["value_tokens"] += float(mask.sum())
    return stats
