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

from typing import Callable

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
