"""Response logprobs and entropy from the LM head, a chunk of positions at a time.

The plain path lets the model build [B, R, V] logits for a whole micro-batch, casts them to
fp32, and autograd keeps them for backward: with a 50k-150k vocabulary that is the largest
tensor of the update. The chunked path instead replaces the head's forward for one call, so
the model hands over the final hidden states and this module applies the head to `chunk`
response positions at a time, each chunk inside torch.utils.checkpoint: backward recomputes a
chunk's logits instead of keeping them, so forward and backward alike hold one chunk's
[chunk, V] logits at most. It runs inside the root FSDP module's forward, where the (tied)
head weight is unsharded, and its gradient flows into that weight as the plain path's does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distflow.algorithms.kl import entropy_from_logits

# Config attributes of models whose forward transforms the head's output further (the chunked
# path would skip that transformation). Gemma's final soft cap is applied here instead (SOFTCAP).
_LOGIT_TRANSFORMS = ("logit_scale", "output_multiplier_scale", "logits_scaling")
SOFTCAP = "final_logit_softcapping"


def logit_softcap(config) -> float | None:
    """The model's final logit soft cap (Gemma 2: logits = cap * tanh(logits / cap)), or None."""
    cap = getattr(config, SOFTCAP, None)
    return float(cap) if cap else None


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None) per position of `logits` [..., V] at `temperature`, in fp32.
    The one formula both paths use, so they differ only in how the logits are cut."""
    logits = logits.float() / temperature
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return lp, entropy_from_logits(logits) if with_entropy else None


def _chunk_stats(h, weight, bias, targets, temperature, with_entropy, head_dtype, softcap):
    if head_dtype is not None and h.dtype != head_dtype:  # e.g. a bf16 model's head in float32
        h, weight = h.to(head_dtype), weight.to(head_dtype)
        bias = None if bias is None else bias.to(head_dtype)
    logits = F.linear(h, weight, bias)
    if softcap is not None:  # as the model's own forward does after its head
        logits = torch.tanh(logits / softcap) * softcap
    lp, ent = token_stats(logits, targets, temperature, with_entropy)
    return (lp, ent) if with_entropy else (lp,)


def chunked_stats(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, mask: torch.Tensor,
                  temperature: float, chunk: int, with_entropy: bool,
                  head_dtype: torch.dtype | None = None, softcap: float | None = None) -> torch.Tensor:
    """Logprobs of `targets` [B, R] (and their entropy) from the hidden states [B, R, H] that
    predict them: [B, R, 1] or, with_entropy, [B, R, 2]; 0 where `mask` is 0 (those positions
    are not computed at all). One tensor, so FSDP's pre-backward hook on the root's output sees both.
    `head_dtype` (None: the model's) is the dtype of the head's matmul: float32 for a bf16 model
    keeps 24 bits of every logit instead of 8 (model.logprob_head_float32). `softcap` is the
    model's final logit soft cap (logit_softcap), which head_replaced keeps its forward from applying.

    At least one chunk runs, possibly empty, so the result stays in the autograd graph (and
    FSDP's backward runs) even when no row has a response token."""
    rows, cols = mask.nonzero(as_tuple=True)
    h, t = hidden[rows, cols], targets[rows, cols]
    outs = []
    for s in range(0, max(len(rows), 1), chunk):
        args = (h[s : s + chunk], head.weight, head.bias, t[s : s + chunk], temperature, with_entropy, head_dtype,
                softcap)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            outs.append(_chunk_stats(*args))
    per_token = torch.stack([torch.cat(parts) for parts in zip(*outs)], dim=-1)
    return per_token.new_zeros((*mask.shape, per_token.shape[-1])).index_put((rows, cols), per_token)


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's LM head, refusing models whose forward post-processes the head's output."""
    for attr in _LOGIT_TRANSFORMS:
        if getattr(model.config, attr, None) not in (None, 1, 1.0, 0, 0.0):
            raise ValueError(f"{type(model).__name__} transforms its logits ({attr}); "
                             "set model.logprob_chunk_tokens=0 for the plain logprob path")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}'s output head is not a Linear layer; "
                         "set model.logprob_chunk_tokens=0 for the plain logprob path")
    return head


@contextmanager
def head_replaced(model: torch.nn.Module, head: torch.nn.Module,
                  forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Run `forward(hidden)` in place of `head`'s own forward for the duration of the block
    (an instance attribute; parameter names and FSDP's registration stay as they are). The
    model's forward would soft-cap what `forward` returns: its cap is off meanwhile, and
    chunked_stats applies it to the logits instead."""
    head.forward = forward
    cap = getattr(model.config, SOFTCAP, None)
    if cap:
        setattr(model.config, SOFTCAP, None)
    try:
        yield
    finally:
        del head.forward
        if cap:
            setattr(model.config, SOFTCAP, cap)
