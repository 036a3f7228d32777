"""Reward functions (see registry for the signature and specs) and the RewardPool that runs them."""

from distflow.tasks.rewards.numeric import extract_answer, numeric_match
from distflow.tasks.rewards.pool import RewardPool
from distflow.tasks.rewards.registry import BUILTIN, load_reward

__all__ = ["BUILTIN", "RewardPool", "extract_answer", "load_reward", "numeric_match"]
