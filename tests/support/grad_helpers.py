"""Shared pieces of the equivalence tests: a fixed batch of samples, an update batch from plain
samples, full gradients of an FSDP2 model, and the one "gradients close" check every
equivalence test uses."""

from __future__ import annotations

import torch

from distflow.sample import Sample
from distflow.train.batch import CURRENT_POLICY, UpdateBatch, pad_rows


def update_batch(samples, advantages=None, old=None, ref=None, values=None, returns=None, pad_id=0,
                 drop_truncated=False) -> UpdateBatch:
    """An UpdateBatch on CPU: advantages one per sample ([N]) or per token ([N, R]); old, ref,
    values and returns as one 1-D tensor per sample (old=None: the ratio is 1)."""
    batch = UpdateBatch.from_samples(samples, pad_id, torch.device("cpu"), drop_truncated)
    width, mask = batch.tokens.resp_mask.shape[1], batch.tokens.resp_mask
    rows = lambda per_sample: pad_rows(list(per_sample), width) if per_sample is not None else None  # noqa: E731
    if advantages is not None:
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        per_token = adv[:, None] if adv.dim() == 1 else pad_rows(list(adv), width)  # one per sample, or per token
        batch = batch.with_(advantages=per_token * mask)
    return batch.with_(old_logprobs=rows(old) if old is not None else CURRENT_POLICY, ref_logprobs=rows(ref),
                       values=rows(values), returns=rows(returns))


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (gathered from the FSDP2 shards)."""
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def grad_errors(g1: dict, g2: dict) -> dict[str, float]:
    """Per gradient, the largest |g1 - g2| relative to g1's own largest entry."""
    return {name: float((g1[name] - g2[name]).abs().max() / g1[name].abs().max().clamp(min=1e-12)) for name in g1}


def assert_grads_close(g1: dict, g2: dict, rel: float = 1e-5, context=None) -> None:
    """Each gradient agrees to `rel` of its own largest entry."""
    assert g1.keys() == g2.keys(), (context, sorted(set(g1) ^ set(g2)))
    for name, err in grad_errors(g1, g2).items():
        assert err <= rel, (context, name, err)


def fixed_batch(vocab: int = 200, n: int = 8):
    g = torch.Generator().manual_seed(7)
    samples, olds = [], []
    for i in range(n):
        p_len, r_len = 3 + (i * 5) % 7, (i * 3) % 6 + (0 if i == 4 else 1)  # i = 4: an empty response
        ids = torch.randint(3, vocab, (p_len + r_len,), generator=g).tolist()
        samples.append(Sample(ids[:p_len], ids[p_len:], [0.0] * r_len, False))
        olds.append(torch.randn(r_len, generator=g) * 0.3)  # perturbation of the current logprobs
    adv = torch.randn(n, generator=g)
    return samples, adv, olds
