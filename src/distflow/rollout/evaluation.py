"""Held-out evaluation: greedy pass@1 and sampled pass@k, sharded over all ranks, and the
validator that decides when it runs.

Each rank evaluates items rank, rank + W, ...; only three counts per metric cross ranks.
A sample passes when its reward reaches PASS_THRESHOLD (the built-in verifiers return 1.0 for
a correct answer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from distflow.config import ValidationConfig
from distflow.distributed import DistInfo, all_reduce
from distflow.tasks.prompts import PromptItem
from distflow.tasks.rewards.pool import RewardPool
from distflow.rollout.episodes import episode_sums
from distflow.rollout.scoring import score_groups
from distflow.seeds import derive_seed

PASS_THRESHOLD = 1.0 - 1e-6


def evaluate(runner, pool: RewardPool, tokenizer, items: list[PromptItem], dist: DistInfo, k: int = 0,
             seed: int = 0, samples_file: Path | None = None) -> dict[str, float]:
    """{"val/pass@1", "val/response_length", "val/items"} (+ "val/pass@k", "val/k" when k > 0; + the
    greedy episodes' "val/turns" and "val/tool_calls" per item, multi-turn).
    `runner` rolls out as training does (distflow.rollout.episodes: single turn, or episodes).
    `samples_file`: where this rank writes its greedy answers, one JSON line per item."""
    mine = items[dist.rank :: dist.world_size]
    # every rank calls the engine, also with no items: ranks sharing a tensor-parallel engine call it together
    greedy = [g[0] for g in runner.run(mine, 1, [0] * len(mine), greedy=True)]
    rewards, _ = score_groups(pool, tokenizer, mine, greedy, 1)
    if samples_file is not None:
        write_samples(samples_file, tokenizer, mine, greedy, rewards[:, 0].tolist(), dist)
    episodes = episode_sums(greedy)  # multi-turn: turns and tool use too (0 for single turns)
    local = [float((rewards >= PASS_THRESHOLD).sum()), float(len(mine)),
             float(sum(len(s.response_ids) for s in greedy)), episodes["turns"], episodes["tool_calls"]]
    if k > 0:
        # keyed by the held-out item, not the rank that draws it
        seeds = [derive_seed(seed, "heldout", dist.rank + i * dist.world_size) for i in range(len(mine))]
        sampled = [s for g in runner.run(mine, k, seeds) for s in g]
        rewards_k, _ = score_groups(pool, tokenizer, mine, sampled, k)
        local.append(float((rewards_k >= PASS_THRESHOLD).any(dim=1).sum()))
    total = all_reduce(local).tolist()
    n = max(total[1], 1.0)
    out = {"val/pass@1": total[0] / n, "val/response_length": total[2] / n, "val/items": total[1]}
    if total[3] > 0:
        out.update({"val/turns": total[3] / n, "val/tool_calls": total[4] / n})
    if k > 0:
        out.update({"val/pass@k": total[5] / n, "val/k": float(k)})
    return out


def write_samples(path: Path, tokenizer, items: list[PromptItem], samples: list, rewards: list[float],
                  dist: DistInfo) -> None:
    """This rank's greedy answers as JSON lines: the item's held-out index, prompt, response, reward."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, (item, s, r) in enumerate(zip(items, samples, rewards)):
            f.write(json.dumps({"item": dist.rank + i * dist.world_size, "prompt": item.prompt_text,
                                "response": tokenizer.decode(s.response_ids), "reward": r,
                                "truncated": s.truncated}) + "\n")


class Validator:
    """When held-out evaluation runs (validation.before_train, .every, .at_end), and the results
    before and after training that summary.json reports (checkpointed with the trainer's state)."""

    def __init__(self, v: ValidationConfig, steps: int, evaluate: Callable[[str], dict[str, float]]):
        """`evaluate(tag)`: one evaluation; the tag (before, stepN, after) names its saved samples."""
        self.v, self.steps, self.evaluate = v, steps, evaluate
        self.evaluations: dict[str, dict[str, float]] = {}

    def before_training(self, step: int) -> None:
        if self.v.before_train and step == 0:
            self.evaluations["before"] = self.evaluate("before")

    def after_step(self, step: int) -> dict[str, float]:
        """The held-out metrics due after `step` (none: {})."""
        if step == self.steps:
            if not self.v.at_end:
                return {}
            self.evaluations["after"] = self.evaluate("after")
            return self.evaluations["after"]
        return self.evaluate(f"step{step}") if self.v.every and step % self.v.every == 0 else {}
