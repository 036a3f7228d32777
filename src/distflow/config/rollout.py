"""The rollout sections: the engine and its sampling, the data each rank draws, and the task
(prompts, answers, rewards, an environment for multi-turn episodes)."""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from distflow.config.fields import knob, section


@section
class RolloutConfig:
    engine: Literal["vllm", "hf"] = knob("vllm", "vllm, or transformers' generate (hf: slower, runs wherever "
                                         "torch runs).", operational=True)
    max_new_tokens: int = knob(32, "Tokens per model turn.")
    max_prompt_tokens: int = knob(256, "Longer prompts are dropped at load (never truncated), counted and logged.")
    temperature: float = knob(1.0, "Sampling temperature (the logprob passes use it too).")
    top_p: float = knob(1.0, "Nucleus sampling.")
    kv_cache_gib: Optional[float] = knob(
        None, "KV cache per engine, GiB, fractions allowed. null: 0.25 on CPU (a token of SmolLM2-135M takes 45 KiB, "
        "so 0.25 GiB holds ~5,800 tokens); on CUDA what gpu_memory_utilization leaves after the weights.",
        operational=True)
    gpu_memory_utilization: float = knob(0.35, "vLLM's share of the GPU's memory (CUDA).", operational=True)
    enforce_eager: Literal["auto", "true", "false"] = knob(
        "auto", "auto: CUDA graphs on CUDA, eager on CPU (distflow.distributed.devices).", operational=True)
    sleep_during_update: bool = knob(True, "Free weights and KV cache during the update phase (CUDA only; a no-op "
                                     "on CPU).", operational=True)
    sync_bucket_mib: int = knob(256, "Parameters are streamed into the engine in buckets of at most this many MiB.",
                                operational=True)
    tensor_parallel_size: int = knob(
        1, "Ranks per vLLM engine: consecutive groups of this many ranks share one tensor-parallel engine (each rank "
        "one worker). Must divide the world size and the model's attention heads.", operational=True)
    max_turns: int = knob(
        1, "Multi-turn episodes (task.env set): model turns per episode, each up to max_new_tokens, with the "
        "environment's observations appended in between (distflow.rollout.episodes). 1: single turn.")
    max_total_tokens: int = knob(
        0, "An episode's response budget (max_turns > 1): generated plus observation tokens over all turns; an "
        "episode that would pass it ends there, marked truncated. 0: max_turns * max_new_tokens.")

    def response_budget(self) -> int:
        """The most response tokens (generated + observations) one sample can hold."""
        if self.max_turns == 1:
            return self.max_new_tokens
        return self.max_total_tokens or self.max_turns * self.max_new_tokens

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
            (self.tensor_parallel_size >= 1,
             f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (self.tensor_parallel_size == 1 or self.engine == "vllm",
             f"rollout.tensor_parallel_size={self.tensor_parallel_size} needs rollout.engine=vllm (the hf engine is "
             "one whole model per rank)"),
            (self.temperature > 0, "rollout.temperature must be > 0"),
            (self.max_turns >= 1, f"rollout.max_turns must be >= 1, got {self.max_turns}"),
            (self.max_total_tokens >= 0, "rollout.max_total_tokens must be >= 0 (0 = max_turns * max_new_tokens), "
             f"got {self.max_total_tokens}"),
            (self.kv_cache_gib is None or self.kv_cache_gib > 0,
             f"rollout.kv_cache_gib must be > 0, got {self.kv_cache_gib}"),
        ]


@section
class DataConfig:
    prompts_per_rank: int = knob(2, "Prompts each rank draws per step (each gives algorithm.group_size samples).")
    shuffle: bool = knob(True, "Reshuffle the prompts every epoch (distflow.tasks.sampler).")

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.prompts_per_rank >= 1, "data.prompts_per_rank must be >= 1")]


@section
class TaskConfig:
    name: Literal["jsonl", "reasoning_gym"] = knob(
        "jsonl", "jsonl: prompts from a local file or a Hub dataset (path); reasoning_gym: a procedural task.")
    path: str = knob("", "A local jsonl/json/parquet/csv file, or a Hub dataset owner/name[:config][@split].")
    prompt_key: str = knob("prompt", "The prompt column: a string (one user turn) or chat messages.")
    answer_key: str = knob("answer", "The reference answer's column (every reward sees it as item['answer']).")
    system_prompt: Optional[str] = knob(None, "A system message put before each prompt that has none.")
    split: str = knob("train", "HF split expression for file datasets (e.g. train[:1000]).")
    heldout_path: str = knob("", "File tasks: the held-out split validation uses.")
    reward: str = knob("numeric", "A built-in reward name or package.module:function (distflow.tasks.rewards.registry).")
    rewards: Dict[str, float] = knob(factory=dict, doc="A weighted combination {reward spec: weight}; when "
                                     "non-empty it replaces reward.")
    reward_timeout_s: float = knob(10.0, "Hard limit per reward call (and per environment step), enforced in the "
                                   "reward pool's worker processes.", operational=True)
    reward_workers: int = knob(2, "Reward worker processes per rank.", operational=True)
    env: str = knob(
        "", "An environment for multi-turn episodes (distflow.tasks.envs): tools (the built-in tool-using environment, "
        "distflow.tasks.envs.ToolEnv) or package.module:Class; empty: single-turn generation. Its steps run in the reward "
        "pool's workers, under reward_timeout_s per step.")
    env_args: Dict[str, Any] = knob(factory=dict, doc="Keyword arguments of the environment's class.")
    gym_dataset: str = knob("basic_arithmetic", "name=reasoning_gym: the dataset's name.")
    gym_config: Dict[str, Any] = knob(factory=dict, doc="name=reasoning_gym: the dataset's config.")
    size: int = knob(1000, "name=reasoning_gym: training items.")
    seed: int = knob(0, "name=reasoning_gym: the training items' seed.")
    heldout_size: int = knob(0, "name=reasoning_gym: held-out items (0: no held-out split).")
    heldout_seed: int = knob(1_000_003, "name=reasoning_gym: a different seed, so held-out items are disjoint from "
                             "training.")

    @property
    def has_heldout(self) -> bool:
        return self.heldout_size >= 1 if self.name == "reasoning_gym" else bool(self.heldout_path)

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.name != "jsonl" or bool(self.path),
             "task.path is not set: give a local jsonl/json/parquet/csv file or a hub dataset name"),
            (self.reward_timeout_s > 0 and self.reward_workers >= 0,
             "task.reward_timeout_s must be > 0 and task.reward_workers >= 0"),
        ]
