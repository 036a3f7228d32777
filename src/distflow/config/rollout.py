"""The rollout section: the engine, its sampling and memory, and multi-turn episodes' lengths."""

from __future__ import annotations

from typing import Literal, Optional

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

    def max_sequence_tokens(self) -> int:
        """The longest sequence the engine is asked about: the post-resync probe resubmits a full
        prompt plus its full response as a prompt and asks for one more token. A multi-turn episode's
        later turns start from up to the whole response budget and may ask for max_new_tokens more
        (distflow.rollout.episodes cuts what passes the budget)."""
        later_turn = self.max_new_tokens if self.max_turns > 1 else 0
        return self.max_prompt_tokens + self.response_budget() + later_turn + 1

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
