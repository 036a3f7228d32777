"""Prompt datasets and their per-rank sampling."""

from distflow.data.prompts import PromptItem, load_prompts
from distflow.data.sampler import ShardedSampler

__all__ = ["PromptItem", "ShardedSampler", "load_prompts"]
