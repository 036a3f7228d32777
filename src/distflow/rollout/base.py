"""The rollout-engine protocol: token ids in, token ids and sampling logprobs out.

Engines never see text or rewards, only token ids, so the policy trains on exactly the tokens
that were sampled (no decode/re-encode drift).
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from distflow.sample import Sample


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
