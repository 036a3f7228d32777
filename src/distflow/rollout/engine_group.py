"""One tensor-parallel engine driven by k consecutive ranks, each rank still asking for its own data.

vLLM's external launcher runs a scheduler on every rank of a tensor-parallel group and needs
every one of them to make the same calls with the same requests in the same order. The trainer
stays SPMD: each rank samples its own prompts and owns its groups. Before every engine call the
ranks of a group all-gather their requests (token ids and per-prompt seeds, a few KB), the
engine serves the concatenation once, and each rank keeps its own slice of the answer. Nothing
funnels through one rank, and what a rank sends depends on its own requests and k, not on the
world size.

Seeds: a prompt's sample seed is derived exactly as with one engine per rank (derive_seed(run
seed, epoch, offset, owning rank, index)) and travels with the prompt, so every rank of the group
hands vLLM the same seed for it; the engine seed (run.seed) is the same on every rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from distflow.distributed import waiting
from distflow.rollout.base import RolloutEngine
from distflow.sample import Sample


class EngineGroup:
    """A RolloutEngine over a tensor-parallel engine shared by the ranks of `group`."""

    def __init__(self, engine: RolloutEngine, group):
        self.engine, self.group = engine, group
        self.index, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _gather(self, request: tuple) -> list[tuple]:
        parts: list = [None] * self.size
        with waiting():
            dist.all_gather_object(parts, request, group=self.group)
        if len({p[0] for p in parts}) != 1:  # the call's options, which must agree across the group
            raise RuntimeError(f"the ranks of a tensor-parallel engine group made different calls: {[p[0] for p in parts]}")
        return parts

    def _mine(self, parts: list[tuple], answers: list) -> list:
        start = sum(len(p[1]) for p in parts[: self.index])
        return answers[start : start + len(parts[self.index][1])]

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        parts = self._gather((("generate", n, greedy), prompts, seeds))
        everyone = [p for part in parts for p in part[1]]
        all_seeds = [s for part in parts for s in part[2]]
        return self._mine(parts, self.engine.generate(everyone, n, all_seeds, greedy))

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        parts = self._gather((("prompt_logprobs",), seqs))
        return self._mine(parts, self.engine.prompt_logprobs([s for part in parts for s in part[1]]))

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Every rank streams the full tensors; vLLM's loader keeps each worker's slice."""
        self.engine.load_weights(weights, version)

    def sleep(self) -> None:
        self.engine.sleep()

    def shutdown(self) -> None:
        self.engine.shutdown()
