"""Tasks: a dataset of prompts plus the reward that scores completions on it."""

from distflow.tasks.gym import gym_reward, gym_rows

__all__ = ["gym_reward", "gym_rows"]
