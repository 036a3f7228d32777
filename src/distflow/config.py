"""Typed run configuration.

These dataclasses are the single schema: the Hydra recipe registers them in its ConfigStore
(so unknown keys and wrong types fail at start-up), and library code only ever sees these
objects, never Hydra. `validate()` checks cross-field rules before any model is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A user-facing configuration or input problem: reported as one line, exit code 2."""


@dataclass
class ModelConfig:
    # A local HF folder, a hub name, or "tiny" (built offline by distflow.models.tiny).
    path: str = "tiny"
    dtype: str = "float32"  # float32 on CPU (no fast bf16 there); bfloat16 on GPU
    trust_remote_code: bool = False


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf
    max_new_tokens: int = 32
    max_prompt_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    # KV cache: GiB on CPU (VLLM_CPU_KVCACHE_SPACE); fraction of GPU memory on CUDA.
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.35
    enforce_eager: bool = True
    # Free weights + KV cache during the update phase (CUDA only; a no-op on CPU).
    sleep_during_update: bool = True
    # Parameters are streamed into the engine in buckets of at most this many MiB.
    sync_bucket_mib: int = 256


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    group_size: int = 4  # samples per prompt, all generated and scored on the same rank
    scale_rewards: bool = True  # divide by the group std (GRPO); false = Dr. GRPO style
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    eps: float = 1e-6  # added to the group std


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
    split: str = "train"
    # A built-in reward name or "package.module:function" (see distflow.rewards.registry).
    reward: str = "numeric"


@dataclass
class TrainerConfig:
    steps: int = 3
    seed: int = 0
    output_dir: str = "outputs/run"
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    collective_timeout_s: float = 600.0
    # Sequences of each step used to check engine logprobs against the policy after resync.
    sync_probe_seqs: int = 2
    progress_bar: bool = True


@dataclass
class DistflowConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> "DistflowConfig":
        """Cross-field checks that need no model, data or process group (so every rank fails alike)."""
        a, r, o = self.algorithm, self.rollout, self.optim
        checks = [
            (r.engine in ("vllm", "hf"), f"rollout.engine must be 'vllm' or 'hf', got {r.engine!r}"),
            (a.group_size >= 2, f"algorithm.group_size must be >= 2 for group-relative advantages, got {a.group_size}"),
            (a.clip_eps_low >= 0 and a.clip_eps_high >= a.clip_eps_low,
             f"need 0 <= algorithm.clip_eps_low <= clip_eps_high, got {a.clip_eps_low}, {a.clip_eps_high}"),
            (a.ppo_epochs >= 1, "algorithm.ppo_epochs must be >= 1"),
            (r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
            (r.temperature > 0, "rollout.temperature must be > 0"),
            (o.micro_batch_size >= 1 and o.mini_batches >= 1, "optim.micro_batch_size and optim.mini_batches must be >= 1"),
            (self.data.prompts_per_rank >= 1, "data.prompts_per_rank must be >= 1"),
            (self.trainer.steps >= 0, "trainer.steps must be >= 0"),
            (self.model.dtype in ("float32", "bfloat16", "float16"), f"model.dtype {self.model.dtype!r} unsupported"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        seqs = self.data.prompts_per_rank * a.group_size
        if seqs % o.mini_batches:
            raise ConfigError(f"{seqs} sequences per rank do not split into optim.mini_batches={o.mini_batches}")
        _check_model_path(self.model.path)
        return self


def _check_model_path(path: str) -> None:
    if path == "tiny":
        return
    looks_local = path.startswith(("/", ".", "~")) or os.path.exists(path) or path.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"model.path {path!r} is not a folder (expected a local HF model folder or a hub name)")


def from_dict(d: dict[str, Any]) -> DistflowConfig:
    """Build a config from a plain nested dict (what OmegaConf.to_container gives); rejects unknown keys."""
    cfg = DistflowConfig()
    for section, values in d.items():
        if not hasattr(cfg, section):
            raise ConfigError(f"unknown config section {section!r}")
        sub = getattr(cfg, section)
        for k, v in (values or {}).items():
            if not hasattr(sub, k):
                raise ConfigError(f"unknown config key {section}.{k}")
            setattr(sub, k, v)
    return cfg
