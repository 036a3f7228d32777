"""The precision contract between engine and trainer: what each side computes the sampled
tokens' logprobs with, so that their difference is the mismatch the rollout correction sees and
nothing a setting could remove.

    weights and body   model.dtype on both sides (one key: an fp32 trainer against a bf16 engine
                       cannot be configured)
    LM head            float32 on both sides when model.head_float32 (the default): the trainer's
                       chunked path, the HF engine through Float32Head, vLLM through its own
                       hf_overrides head_dtype=float32; in the model dtype on both sides otherwise
    log-softmax        float32 on both sides, of the temperature-scaled logits: the trainer's
                       token_stats, vLLM's processed_logprobs, the HF engine's warp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distflow.config import DistflowConfig
from distflow.distributed.devices import compute_dtype


class Float32Head:
    """Makes a transformers model's output head compute in float32: its forward casts the hidden
    states to float32 and multiplies them by a float32 copy of the head's weight (refreshed after
    every weight load), as the trainer's chunked logprob path does. The module and its parameter
    names stay as they were, so weight sync is unchanged."""

    def __init__(self, model: torch.nn.Module):
        self.head = model.get_output_embeddings()
        self.weight = self.bias = None
        self.refresh()
        self.head.forward = self.forward

    @torch.no_grad()
    def refresh(self) -> None:
        self.weight = self.head.weight.detach().float()
        self.bias = None if self.head.bias is None else self.head.bias.detach().float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight, self.bias)


# Measured on the demo (SmolLM2-135M, bf16, vLLM, 2 CPU ranks; bench/precision.py, docs/performance.md
# "The precision contract"): the tokens PPO's clip cuts at step 1 when the engine's logprobs are
# the old policy's (bypass mode).
BYPASS_BF16_CLIPPED = "0.2%"


def cache_float32_head(worker) -> None:
    """With a float32 head (hf_overrides head_dtype), vLLM's CPU path casts the head's weight to
    float32 at every decode step (on CUDA it accumulates a bf16 matmul in float32 instead): keep
    one float32 copy of this rank's shard, made again after each weight load, and multiply by it.
    The same values as vLLM's cast, without the cast (1.6x slower generation on the demo). The head
    is whatever module the model hands its logits processor: `lm_head`, or the embedding itself
    where a tied model (Gemma) has no `lm_head`."""
    model = worker.model_runner.get_model()
    float32_weights: dict = {}  # head module -> its float32 weight, filled at the first decode step

    def apply_head(lm_head, hidden_states, embedding_bias):
        weight = float32_weights.get(lm_head)
        if weight is None:
            weight = float32_weights[lm_head] = lm_head.weight.detach().float()
        bias = None if embedding_bias is None else embedding_bias.float()
        return F.linear(hidden_states.float(), weight, bias)

    model.logits_processor._apply_head = apply_head


def contract_lines(cfg: DistflowConfig) -> list[str]:
    """Start-up lines where engine and trainer do not compute alike and the run depends on it:
    bypass mode clips the PPO ratio against a bf16 engine's logprobs."""
    lines, bf16 = [], compute_dtype(cfg.model.dtype) != torch.float32
    if bf16 and cfg.algorithm.rollout_correction.bypass_mode:
        lines.append("precision: rollout_correction.bypass_mode clips the PPO ratio against the bf16 engine's "
                     f"logprobs: on the demo the numerics alone clip {BYPASS_BF16_CLIPPED} of the tokens at step 1 "
                     "(docs/performance.md#the-precision-contract)")
    return lines
