"""Tasks: the prompts of each split and how they render, the reward that scores completions, and
the environment that answers a multi-turn episode's turns (rewards/, envs/), gathered in one
object, Task (task.py), with the worker processes that run them."""

from distflow.tasks.gym import gym_reward, gym_rows
from distflow.tasks.prompts import PromptItem, load_prompts
from distflow.tasks.sampler import ShardedSampler
from distflow.tasks.task import Task

__all__ = ["PromptItem", "ShardedSampler", "Task", "gym_reward", "gym_rows", "load_prompts"]
