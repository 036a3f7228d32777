"""The rollout-engine protocol: token ids in, token ids and sampling logprobs out.

Engines never see text or rewards, only token ids, so the policy trains on exactly the tokens
that were sampled (no decode/re-encode drift).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from distflow.config import ModelConfig, RolloutConfig


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    # Log-probability of each response token under the engine's sampling distribution
    # (after temperature), as the engine computed it.
    logprobs: list[float]
    truncated: bool  # hit max_new_tokens without an end-of-sequence token (an episode: its budget)
    # Multi-turn episodes (distflow.episodes): 1 on each generated token, 0 on each observation
    # token the environment appended between turns (context, never trained); None = all generated.
    mask: list[int] | None = None
    episode: "EpisodeInfo | None" = None  # what the episode did (turns, transcript, tool counts)

    @property
    def generated(self) -> int:
        """Response tokens the model generated (observation tokens excluded)."""
        return len(self.response_ids) if self.mask is None else sum(self.mask)


@dataclass
class EpisodeInfo:
    """One multi-turn episode beyond its token ids: what scoring and the metrics read."""

    transcript: list[dict] = field(default_factory=list)  # the model's turns and the observations, as messages
    turns: int = 0  # model turns generated
    env_reward: float = 0.0  # the sum of the environment's step rewards
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, failed tools, failed environment steps
    tool_timeouts: int = 0

    @property
    def final_text(self) -> str:
        """The model's last turn: the answer a task reward scores."""
        return next((m["content"] for m in reversed(self.transcript) if m["role"] == "assistant"), "")


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        """n samples for each prompt (grouped by prompt); seeds make sampling reproducible."""

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """logp(seq[t] | seq[:t]) for t >= 1 at temperature 1: used to verify weight sync."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all weights in place from a stream of (HF parameter name, full tensor); wakes a
        sleeping engine (the resync is the only way out of sleep)."""

    def sleep(self) -> None:
        """Free what the engine can for the update phase; nothing generates until load_weights."""

    def shutdown(self) -> None: ...


def build_engine(model_path: str, model: ModelConfig, rollout: RolloutConfig, device: torch.device, seed: int,
                 group=None) -> RolloutEngine:
    """Construct the configured engine. Must be called on every rank together (vLLM runs a collective).
    `group`: this rank's engine group (ParallelLayout.engine_group) when rollout.tensor_parallel_size > 1."""
    if rollout.engine == "vllm":
        from distflow.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_path, model, rollout, device, seed)
        if rollout.tensor_parallel_size == 1:
            return engine
        from distflow.rollout.engine_group import EngineGroup

        assert group is not None, "a tensor-parallel engine needs its ranks' group (ParallelLayout.engine_group)"
        return EngineGroup(engine, group)
    from distflow.rollout.hf_engine import HFEngine

    return HFEngine(model_path, model, rollout, device)
