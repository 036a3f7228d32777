"""Resolve `task.reward` to a callable.

Every reward has one signature, so built-ins and user functions are interchangeable:

    fn(prompt: str, completion: str, completion_ids: list[int], item: dict) -> float

`item` is the dataset row (the reference answer is `item[task.answer_key]`, also given as
`item["answer"]` when the row has no such column). A spec is a built-in name or a dotted path
`package.module:function`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from distflow.config import ConfigError
from distflow.rewards.numeric import numeric_match

RewardFn = Callable[[str, str, list, dict], float]


def numeric_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    return numeric_match(completion, str(item["answer"]))


BUILTIN: dict[str, RewardFn] = {"numeric": numeric_reward}


def load_reward(spec: str) -> RewardFn:
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"task.reward {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task.reward {spec!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ConfigError(f"task.reward {spec!r} is not callable")
    return fn
