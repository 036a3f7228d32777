"""Resolve `task.reward` to a callable.

Every reward has one signature, so built-ins and user functions are interchangeable:

    fn(prompt: str, completion: str, completion_ids: list[int], item: dict) -> float

`item` is the dataset row (the reference answer is `item[task.answer_key]`, also given as
`item["answer"]` when the row has no such column). A spec is a built-in name or a dotted path
`package.module:function`. Built-ins: numeric, math, gsm8k, countdown, format, length_penalty, tool_use
(see distflow.tasks.rewards.builtin). Rewards are run by distflow.tasks.rewards.pool.RewardPool, in worker
processes that resolve the spec themselves, so a user function need not be picklable.

A reward may carry a `prepare` attribute (a no-argument callable): pool workers call it once at
start-up, before taking calls, to pay one-off costs (heavy imports) outside the per-call timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from distflow.config import ConfigError
from distflow.config.specs import resolve
from distflow.tasks.rewards.builtin import (
    countdown_reward,
    format_reward,
    gsm8k_reward,
    length_penalty_reward,
    math_reward,
    tool_use_reward,
)
from distflow.tasks.rewards.numeric import numeric_match

RewardFn = Callable[[str, str, list, dict], float]


def numeric_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    return numeric_match(completion, str(item["answer"]))


BUILTIN: dict[str, RewardFn] = {
    "numeric": numeric_reward,
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "countdown": countdown_reward,
    "format": format_reward,
    "length_penalty": length_penalty_reward,
    "tool_use": tool_use_reward,
}


def load_reward(spec: str) -> RewardFn:
    return resolve(spec, BUILTIN, "task.reward")


@dataclass(frozen=True)
class RewardSpec:
    """A task's reward with every spec resolved: one spec, or a weighted combination {spec: weight}
    whose reward is sum(weight * component). Resolving here, in the trainer's process, makes a typo
    a ConfigError at start-up, before any worker process starts or any row loads."""

    components: list[tuple[str, float]]  # (spec, weight), in the config's order
    fns: list[RewardFn]  # the resolved functions, one per component

    @classmethod
    def parse(cls, spec: str | dict[str, float]) -> "RewardSpec":
        items = spec.items() if isinstance(spec, dict) else [(spec, 1.0)]
        components = [(s, _weight(w)) for s, w in items]
        if not components:
            raise ConfigError("task.rewards is an empty combination")
        for (s, w), (_, written) in zip(components, items):
            if not isinstance(s, str) or w is None or not math.isfinite(w):
                raise ConfigError(f"reward {s!r} with weight {written!r}: need a spec string and a finite weight")
        return cls(components, [load_reward(s) for s, _ in components])

    @classmethod
    def from_task(cls, task) -> "RewardSpec":
        """A TaskConfig's `rewards` when non-empty, else its `reward`."""
        return cls.parse(dict(task.rewards) or task.reward)

    @property
    def specs(self) -> list[str]:
        return [s for s, _ in self.components]


def _weight(value) -> float | None:
    """A combination's weight as a float; None for what is not a number (a bool is not one)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
