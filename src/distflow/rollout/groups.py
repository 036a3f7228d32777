"""A rank's generated groups, as they leave rollout: prompts, samples, and what happened.

Groups are the unit that moves: all G samples of a prompt stay together on one rank (for
group-relative advantages), whether they are filtered (DAPO's dynamic sampling) or moved
between ranks (distflow.rollout.balance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distflow.tasks.prompts import PromptItem
from distflow.rollout.scoring import REWARD_FAILURES
from distflow.sample import Sample, training_rows


@dataclass
class RolloutStats:
    """Counts from generation, scoring and balancing on this rank."""

    reward_failures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REWARD_FAILURES, 0.0))
    rounds: int = 0
    generated_groups: int = 0
    balance: dict[str, float] = field(default_factory=dict)
    pipeline: dict[str, float] = field(default_factory=dict)  # carry-over counts (distflow.rollout.driver)

    def add_failures(self, counts: dict[str, float]) -> None:
        for k in REWARD_FAILURES:
            self.reward_failures[k] += counts.get(k, 0.0)


@dataclass
class Rollouts:
    """Samples in group-major order (group_size consecutive per prompt). `rewards` ([groups, G])
    is set only where scoring had to finish during rollout (dynamic sampling filters on it)."""

    group_size: int
    items: list[PromptItem] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    stats: RolloutStats = field(default_factory=RolloutStats)

    def groups(self) -> list[tuple]:
        """(item, its samples, its rewards row or None) per prompt."""
        g = self.group_size
        return [(item, self.samples[i * g : (i + 1) * g], self.rewards[i] if self.rewards is not None else None)
                for i, item in enumerate(self.items)]

    def set_groups(self, groups: list[tuple]) -> None:
        self.items = [item for item, _, _ in groups]
        self.samples = [s for _, samples, _ in groups for s in samples]
        if self.rewards is not None:
            self.rewards = torch.stack([r for _, _, r in groups]) if groups else torch.zeros((0, self.group_size))

    def keep_groups(self, other: "Rollouts", keep: torch.Tensor) -> None:
        """Append the groups of `other` (scored) selected by the boolean mask `keep`."""
        g = self.group_size
        for i in keep.nonzero().flatten().tolist():
            self.items.append(other.items[i])
            self.samples += other.samples[i * g : (i + 1) * g]
        chosen = other.rewards[keep]
        self.rewards = chosen if self.rewards is None else torch.cat([self.rewards, chosen])

    def token_costs(self) -> list[int]:
        """Prompt + response tokens per group: what the update pays for it (every row of a sample)."""
        return [sum(len(r.prompt_ids) + len(r.response_ids) for r in training_rows(samples)[0])
                for _, samples, _ in self.groups()]
