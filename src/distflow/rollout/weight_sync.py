"""Stream the FSDP2 policy's full parameters into the local rollout engine.

Every rank gathers each parameter (DTensor.full_tensor(), an all-gather within FSDP's mesh)
and hands it to its own engine: nothing is written to disk and nothing funnels through one
rank. Parameters are gathered a bucket at a time, so the peak extra memory is one bucket,
not a full model copy. All ranks must consume the stream fully and in the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def max_logprob_diff(engine, policy, seqs: list[list[int]], pad_id: int) -> float:
    """Max |engine - policy| logprob of every token after the first of `seqs`, at temperature 1:
    after a resync the two must agree (a wrong or partial resync shows up here)."""
    from distflow.batch import TokenBatch
    from distflow.rollout.base import Sample

    engine_lp = engine.prompt_logprobs(seqs)
    as_samples = [Sample(seq[:1], seq[1:], [], False) for seq in seqs]
    policy_lp = policy.logprobs(TokenBatch.from_samples(as_samples, pad_id, policy.device), 1.0)
    diff = 0.0
    for i, lp in enumerate(engine_lp):
        ref = policy_lp[i, : len(lp)].float().cpu()
        diff = max(diff, float((torch.tensor(lp) - ref).abs().max()))
    return diff


def full_parameters(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor in `dtype`) for every unique parameter of `model`.

    named_parameters() deduplicates tied weights (e.g. lm_head tied to embed_tokens), so a
    tied head is sent once under the embedding's name; engines that keep a separate head
    copy must refresh it (see the vLLM engine).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        t = param.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        t = t.to(dtype)
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield from bucket
            bucket, size = [], 0
    yield from bucket
