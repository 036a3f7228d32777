"""A start-up check that one rank's GPU can hold what the run will put on it, before anything is
allocated: the first wake-up of the engine comes after the first update has allocated AdamW's
state, so a run that does not fit would otherwise fail minutes in, at its first resync.

The estimate is arithmetic from the parameter count and the model's shapes (docs/scaling.md,
"GPU memory"), per rank, for the two moments that matter:

  generate  the awake engine (rollout.gpu_memory_utilization of the card, or its weights plus
            rollout.kv_cache_gib when that is set), beside everything that stays between steps:
            float32 master weights (4 B per parameter / shard ranks), AdamW's two moments (8 B),
            the frozen KL reference and any other frozen model (a distillation teacher, reward
            models, judges; in the compute dtype, or two gathered blocks of one that is offloaded
            to host memory), the critic, one resync bucket, and
            the CUDA context and NCCL's buffers;
  update    the same without the engine when it sleeps (rollout.sleep_during_update), plus the
            float32 gradients, the gathered blocks and one micro-batch's activations and logits.

A split run (pipeline.mode=split) checks both roles on every rank, so all stop with the same line: the
trainers as above, their engine asleep through every update (it wakes only to validate), and the
rollout ranks, which hold no training state but their engine, awake throughout, beside the versions
they have received and not applied yet (pipeline.max_staleness of them when staged, one inflight),
each a full copy of the weights, unless pipeline.staging=host keeps them in host memory.

Activations are the coarse term: per token, with activation checkpointing, each block's saved
input and one block's recompute; without it, every block's intermediates. Run with
run.memory_check=false to train past a refusal this estimate got wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Collection

from distflow.config import ConfigError, DistflowConfig
from distflow.config.pipeline import BROADCAST_BUCKET_BYTES

GIB = 2**30
CONTEXT_BYTES = 2 * GIB  # CUDA context, NCCL's buffers, the allocator's fragmentation
ENGINE_OVERHEAD_BYTES = 1 * GIB  # vLLM's own buffers when the KV cache is sized explicitly


@dataclasses.dataclass(frozen=True)
class ModelShape:
    parameters: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config, parameters: int) -> "ModelShape":
        text = getattr(config, "text_config", None) or config
        hidden = int(text.hidden_size)
        return cls(parameters, hidden, int(text.num_hidden_layers),
                   int(getattr(text, "intermediate_size", None) or 4 * hidden), int(text.vocab_size))


def estimate(cfg: DistflowConfig, policy: ModelShape, critic: ModelShape | None, device_bytes: int,
             shard: int, engine_tp: int, compute_bytes: int,
             others: dict[str, ModelShape] | None = None,
             offloaded: Collection[str] = ()) -> dict[str, dict[str, float]]:
    """Bytes per rank by item, for the generate and the update phase. `others`: the models besides the
    policy, reference and critic (a distillation teacher, reward models, judges) by name, each held in
    the compute dtype between steps, or, named in `offloaded`, in host memory but for the two gathered
    blocks (one running, one prefetched) its forward puts on the device."""
    m, o, r = cfg.model, cfg.optim, cfg.rollout
    trainable = 0 if m.lora.enabled else policy.parameters  # LoRA: adapters only, a rounding error here
    frozen = policy.parameters if m.lora.enabled else 0  # the LoRA base, in the compute dtype
    always = {
        "policy weights": (4 * trainable + compute_bytes * frozen) / shard,
        "AdamW state": 8 * trainable / shard,
        "CUDA context and NCCL": CONTEXT_BYTES,
    }
    if cfg.algorithm.needs_reference and not m.lora.enabled:
        always["KL reference"] = compute_bytes * policy.parameters / shard
    if critic is not None:
        always["critic weights and AdamW state"] = 12 * critic.parameters / shard
    for name, shape in (others or {}).items():
        if name in offloaded:
            always[f"{name} (offloaded)"] = 2 * compute_bytes * shape.parameters / max(shape.layers, 1)
        else:
            always[name] = compute_bytes * shape.parameters / shard
    engine = engine_bytes(cfg, policy, device_bytes, engine_tp, compute_bytes)
    generate = {**always, "vLLM engine": engine, "resync bucket": r.sync_bucket_mib * 2**20}
    tokens = o.micro_batch_tokens or o.micro_batch_size * (r.max_prompt_tokens + r.max_new_tokens)
    block = compute_bytes * (10 * policy.hidden + 3 * policy.intermediate)  # one block's intermediates per token
    saved = compute_bytes * policy.hidden * policy.layers + block if m.activation_checkpointing \
        else block * policy.layers
    logit_tokens = min(tokens, m.logprob_chunk_tokens) if m.logprob_chunk_tokens else tokens
    update = {**always,
              "gradients": 4 * (trainable + (critic.parameters if critic else 0)) / shard,
              "gathered blocks": 2 * compute_bytes * policy.parameters / max(policy.layers, 1),
              "activations": tokens * saved,
              "logits": 3 * 4 * logit_tokens * policy.vocab}
    if not r.sleep_during_update and cfg.pipeline.mode != "split":  # a split trainer's engine wakes to validate only
        update["vLLM engine"] = engine
    phases = {"generate": generate, "update": update}
    if cfg.pipeline.mode == "split":
        phases["rollout ranks' generate"] = rollout_rank_estimate(cfg, policy, device_bytes, engine_tp, compute_bytes)
    return phases


def engine_bytes(cfg: DistflowConfig, policy: ModelShape, device_bytes: int, engine_tp: int,
                 compute_bytes: int) -> float:
    """The awake engine: rollout.gpu_memory_utilization of the card, or its weights' slice plus the KV cache."""
    r = cfg.rollout
    if r.kv_cache_gib is None:
        return r.gpu_memory_utilization * device_bytes
    return compute_bytes * policy.parameters / engine_tp + r.kv_cache_gib * GIB + ENGINE_OVERHEAD_BYTES


def rollout_rank_estimate(cfg: DistflowConfig, policy: ModelShape, device_bytes: int, engine_tp: int,
                          compute_bytes: int) -> dict[str, float]:
    """A split run's rollout rank: no policy, optimizer or frozen model, but its engine, awake throughout,
    beside the versions it has received and not applied yet, each a full copy of the weights whatever
    the engine's tensor-parallel size (pipeline.versions_ahead)."""
    p = cfg.pipeline
    return {"CUDA context and NCCL": CONTEXT_BYTES,
            "vLLM engine": engine_bytes(cfg, policy, device_bytes, engine_tp, compute_bytes),
            "staged versions": p.staged_on_device * compute_bytes * policy.parameters,
            "received bucket": BROADCAST_BUCKET_BYTES}


def check(phases: dict[str, dict[str, float]], device_bytes: int) -> None:
    """One line naming the phase, the largest items and the knobs, when a phase does not fit."""
    for phase, items in phases.items():
        total = sum(items.values())
        if total <= device_bytes:
            continue
        top = sorted(items.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in top)
        knobs = {"generate": "lower rollout.gpu_memory_utilization (or set rollout.kv_cache_gib), or shard over more "
                             "ranks (model.shard_ranks, more GPUs)",
                 "update": "set model.activation_checkpointing=true, lower optim.micro_batch_size or set "
                           "optim.micro_batch_tokens, keep rollout.sleep_during_update=true, or shard over more ranks",
                 "rollout ranks' generate": "set pipeline.staging=host (the received versions wait in host memory), "
                                            "lower pipeline.max_staleness (a staged rollout rank holds up to that "
                                            "many; pipeline.apply=inflight one), or lower "
                                            "rollout.gpu_memory_utilization (or set rollout.kv_cache_gib)"}[phase]
        raise ConfigError(f"the {phase} phase needs about {total / GIB:.1f} GiB per GPU ({parts} GiB), more than the "
                          f"device's {device_bytes / GIB:.1f} GiB: {knobs}; run.memory_check=false skips this estimate")


def model_shape(config, trust_remote_code: bool = False) -> ModelShape:
    """The shape of the causal LM an HF config describes, its parameters counted on a meta skeleton
    (no memory, no RNG draws)."""
    from transformers import AutoModelForCausalLM

    from distflow.models.anatomy import skeleton

    model = skeleton(AutoModelForCausalLM, config, trust_remote_code)
    return ModelShape.of(config, sum(p.numel() for p in model.parameters()))


def check_memory_budget(cfg: DistflowConfig, model_path: str, layout, critic_path: str | None = None,
                        device_bytes: int | None = None, policy_shape: ModelShape | None = None,
                        critic_shape: ModelShape | None = None,
                        others: dict[str, ModelShape] | None = None,
                        offloaded: Collection[str] = ()) -> dict[str, dict[str, float]] | None:
    """The estimate for this run on the layout's device (CUDA; `device_bytes` defaults to its total
    memory), refused with one line when it does not fit; None on CPU or with run.memory_check=false.
    Reads the configs and builds meta skeletons only, unless the shapes are given (the start-up plan
    has them). `cfg` must be concrete: model.dtype="auto" is refused (the plan resolves it)."""
    if device_bytes is None and (layout.device.type != "cuda" or not cfg.run.memory_check):
        return None
    import torch
    from transformers import AutoConfig

    from distflow.distributed.devices import compute_dtype

    def shape(path: str) -> ModelShape:
        return model_shape(AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code),
                           cfg.model.trust_remote_code)

    compute = compute_dtype(cfg.model.dtype).itemsize
    total = torch.cuda.mem_get_info(layout.device)[1] if device_bytes is None else device_bytes
    critic = None
    if critic_path and cfg.has_critic:
        critic = critic_shape or shape(critic_path)
    phases = estimate(cfg, policy_shape or shape(model_path), critic, total, layout.shard, layout.engine_tp, compute,
                      others, offloaded)
    check(phases, total)
    return phases
