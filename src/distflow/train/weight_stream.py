"""Stream the FSDP2 policy's full parameters into the local rollout engine.

Every rank gathers each parameter (DTensor.full_tensor(), an all-gather within FSDP's mesh)
and hands it to its own engine: nothing is written to disk and nothing funnels through one
rank. Each shard is cast to the engine's dtype before the gather, so bf16 engines get half the
bytes of the fp32 master weights over the link, and no full-size fp32 temporary exists.
Parameters are gathered a bucket at a time, so the peak extra memory is one bucket,
not a full model copy. All ranks must consume the stream fully and in the same order.
The engine side only consumes (name, tensor) pairs (`RolloutEngine.load_weights`).
"""

from __future__ import annotations

from typing import Iterator

import torch

from distflow.train.lora import merged_parameters


def full_parameters(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor in `dtype`) for every unique parameter of `model`; a model with
    LoRA adapters yields its base weights with the adapters merged in, under the HF names
    (distflow.train.lora.merged_parameters).

    named_parameters() deduplicates tied weights (e.g. lm_head tied to embed_tokens), so a
    tied head is sent once under the embedding's name; engines that keep a separate head
    copy must refresh it (see the vLLM engine).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in merged_parameters(model, dtype):
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield from bucket
            bucket, size = [], 0
    yield from bucket
