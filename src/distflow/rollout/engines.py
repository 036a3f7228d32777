"""Build the configured rollout engine: vLLM (one per rank, or one per tensor-parallel group of
ranks) or transformers `generate`. The engines import lazily: a run loads only its own."""

from __future__ import annotations

import torch

from distflow.config import ModelConfig, RolloutConfig
from distflow.rollout.base import RolloutEngine


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
