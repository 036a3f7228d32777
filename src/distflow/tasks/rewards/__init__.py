"""Reward functions (see registry for the signature and specs) and the TaskWorkers (RewardPool)
that run them, and environment steps, in worker processes."""

from distflow.tasks.rewards.numeric import extract_answer, numeric_match
from distflow.tasks.rewards.pool import RewardPool, TaskWorkers
from distflow.tasks.rewards.registry import BUILTIN, RewardSpec, load_reward

__all__ = ["BUILTIN", "RewardPool", "RewardSpec", "TaskWorkers", "extract_answer", "load_reward", "numeric_match"]
