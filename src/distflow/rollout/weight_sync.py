"""Stream the FSDP2 policy's full parameters into the local rollout engine.

Every rank gathers each parameter (DTensor.full_tensor(), an all-gather within FSDP's mesh)
and hands it to its own engine: nothing is written to disk and nothing funnels through one
rank. Each shard is cast to the engine's dtype before the gather, so bf16 engines get half the
bytes of the fp32 master weights over the link, and no full-size fp32 temporary exists.
Parameters are gathered a bucket at a time, so the peak extra memory is one bucket,
not a full model copy. All ranks must consume the stream fully and in the same order.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from distflow.train.lora import merged_parameters

log = logging.getLogger("distflow")

# The probe stops the run above these max |engine - policy| logprobs (run.allow_engine_mismatch:
# it warns instead). In float32 both sides compute the same function and differ by summation
# order: <= 1e-6 on the tiny model and 6e-5 to 1.3e-4 on SmolLM2-135M with vLLM on CPU (the demo's
# metrics), so 1e-3 already means a wrong or partial resync. In bfloat16 the engine's kernels round
# differently from the trainer's, and the max over a step's prompt and response tokens reached 0.35
# to 1.26 nats on healthy SmolLM2 demo runs (vLLM on CPU, 8 probes; the trained tokens' own mean
# |diff| is ~0.035, mismatch/abs_mean); unloaded or wrong tensors give several nats. So bf16's
# probe catches only a broken resync; the exactness check is float32's. docs/concepts.md lists the
# expected ranges.
PROBE_LIMIT = {"float32": 1e-3, "bfloat16": 3.0}


@torch.no_grad()
def max_logprob_diff(engine, policy, seqs: list[list[int]], pad_id: int, rows=None) -> float:
    """Max |engine - policy| logprob of every token after the first of `seqs`, at temperature 1:
    after a resync the two must agree (a wrong or partial resync shows up here). `rows`: the
    same sequences as a `TokenBatch` that scores all their tokens (`TokenBatch.whole`, the
    step's own rows, not padded again); padded from `seqs` when None."""
    from distflow.sample import Sample
    from distflow.train.batch import TokenBatch

    engine_lp = engine.prompt_logprobs(seqs)
    if rows is None:
        rows = TokenBatch.from_samples([Sample(seq[:1], seq[1:], [], False) for seq in seqs], pad_id, policy.device)
    policy_lp = policy.logprobs(rows, 1.0)
    diff = 0.0
    for i, lp in enumerate(engine_lp):
        ref = policy_lp[i, : len(lp)].float().cpu()
        diff = max(diff, float((torch.tensor(lp) - ref).abs().max()))
    return diff


def mismatch_line(diff: float, dtype: str, model_type: str, when: str) -> str | None:
    """None while `diff` is what `dtype` explains (PROBE_LIMIT), else the one line that says the
    engine does not compute what the policy trains. NaN (nothing probed) passes."""
    limit = PROBE_LIMIT[dtype]
    if not diff > limit:
        return None
    return (f"{when}: the engine's logprobs differ from the policy's by up to {diff:.3g} ({model_type}, {dtype}; at "
            f"most {limit:g} expected): the engine does not compute what the policy trains, or does not hold its "
            "weights; run.allow_engine_mismatch=true trains anyway")


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


class CheckpointNames:
    """Renames a resync stream from transformers' in-memory parameter names to the names its model
    folders hold, which is what vLLM's loaders read.

    transformers 5 fuses and renames some weights when it loads them: a mixture-of-experts layer's
    per-expert `experts.<i>.gate_proj/up_proj/down_proj` become one `experts.gate_up_proj`
    [E, 2I, H] and one `experts.down_proj` [E, H, I], and Mixtral's `block_sparse_moe` becomes `mlp`.
    vLLM's Mixtral loader refuses the in-memory names outright ("no module named layers.0.mlp"), so
    the engine gets what `save_pretrained` would have written: the reversal of transformers' own
    conversion table (`revert_weight_conversion`), applied one module's parameters at a time so
    that no more than one module's weights are held at once.
    Dense families have no conversion and pass through untouched."""

    def __init__(self, config, trust_remote_code: bool = False):
        """`config`: the model folder's transformers config."""
        from transformers import AutoModelForCausalLM

        from distflow.train.model_init import skeleton

        self.model = skeleton(AutoModelForCausalLM, config, trust_remote_code)
        self.revert = _reverter(self.model)

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.revert is None:
            yield from weights
            return
        group: dict[str, torch.Tensor] = {}
        for name, t in weights:
            if group and _module_of(name) != _module_of(next(iter(group))):
                yield from self.revert(self.model, group).items()
                group = {}
            group[name] = t
        if group:
            yield from self.revert(self.model, group).items()


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def _reverter(model: torch.nn.Module):
    """transformers' `revert_weight_conversion` where `model` has conversions to revert, else None."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions stores what it loads
        return None
    # the same selection revert_weight_conversion makes for a model not loaded by from_pretrained
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return revert_weight_conversion if conversions else None
