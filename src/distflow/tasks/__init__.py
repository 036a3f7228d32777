"""Tasks: a task is one object (`Task`) that owns its rows per split and how they render, the reward
that scores completions, the environment that answers a multi-turn episode's turns (rewards/,
envs/), and the worker processes that run this user code under deadlines.

The names below load on first use: reward and environment workers are fresh interpreters that
import `distflow.tasks.rewards` and must not pay for torch and datasets, which the rows need.
"""

from importlib import import_module

_EXPORTS = {
    "PromptItem": "distflow.tasks.prompts",
    "load_prompts": "distflow.tasks.prompts",
    "ShardedSampler": "distflow.tasks.sampler",
    "Task": "distflow.tasks.task",
    "gym_reward": "distflow.tasks.gym",
    "gym_rows": "distflow.tasks.gym",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
