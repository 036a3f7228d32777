"""Shared pieces of the equivalence tests: an update batch from plain samples, full gradients
of an FSDP2 model, and the one "gradients close" check every equivalence test uses."""

from __future__ import annotations

import torch

from distflow.batch import CURRENT_POLICY, UpdateBatch, pad_rows, per_token


def update_batch(samples, advantages=None, old=None, ref=None, values=None, returns=None, pad_id=0,
                 drop_truncated=False) -> UpdateBatch:
    """An UpdateBatch on CPU: advantages one per sample ([N]) or per token ([N, R]); old, ref,
    values and returns as one 1-D tensor per sample (old=None: the ratio is 1)."""
    batch = UpdateBatch.from_samples(samples, pad_id, torch.device("cpu"), drop_truncated)
    width, mask = batch.tokens.resp_mask.shape[1], batch.tokens.resp_mask
    rows = lambda per_sample: pad_rows(list(per_sample), width) if per_sample is not None else None  # noqa: E731
    if advantages is not None:
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        batch = batch.with_(advantages=per_token(adv if adv.dim() == 1 else pad_rows(list(adv), width), mask))
    return batch.with_(old_logprobs=rows(old) if old is not None else CURRENT_POLICY, ref_logprobs=rows(ref),
                       values=rows(values), returns=rows(returns))


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (gathered from the FSDP2 shards)."""
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def assert_grads_close(g1: dict, g2: dict, rel: float = 1e-5, context=None) -> None:
    """Each gradient agrees to `rel` of its own largest entry."""
    assert g1.keys() == g2.keys(), (context, sorted(set(g1) ^ set(g2)))
    for name in g1:
        scale = g1[name].abs().max().clamp(min=1e-12)
        err = float((g1[name] - g2[name]).abs().max() / scale)
        assert err <= rel, (context, name, err)
