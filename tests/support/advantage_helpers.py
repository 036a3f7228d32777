"""The advantage estimators called as the trainer calls them, on plain Python batches: shared by the
estimator tests (unit/test_advantages.py) and their gloo-rank counterpart."""

from __future__ import annotations

import random

import torch

from distflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, local_sum
from distflow.config import AlgorithmConfig

TOKEN_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def cfg(name: str, group_size: int, gamma: float = 1.0) -> AlgorithmConfig:
    """drgrpo is grpo without the std (as recipes/algorithm/drgrpo.yaml)."""
    return AlgorithmConfig(advantage="grpo" if name == "drgrpo" else name, scale_rewards=name != "drgrpo",
                           group_size=group_size, gamma=gamma)


def estimate(name, scores, token_rewards, lengths, group_size, gamma=1.0, global_sum=local_sum,
             dtype=torch.float32):
    width = max([1, *lengths])
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=dtype).reshape(-1, width)
    tr = torch.tensor([row + [0.0] * (width - len(row)) for row in token_rewards], dtype=dtype).reshape(-1, width)
    inputs = AdvantageInputs(torch.tensor(scores, dtype=dtype), tr * mask, mask)
    adv, _ = ADVANTAGE_ESTIMATORS[cfg(name, group_size).advantage](inputs, cfg(name, group_size, gamma), global_sum)
    return adv


def random_batch(seed, groups, size, with_empty=True, equal_every=3):
    rng = random.Random(seed)
    scores, lengths, token_rewards = [], [], []
    for g in range(groups):
        if g % equal_every == 0:
            v = rng.choice([0.0, 0.7, 1.0, 0.3])
            scores += [v] * size
        else:
            scores += [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(size)]
    for i in range(groups * size):
        n = 0 if (with_empty and i == 5) else rng.randint(1, 9)
        lengths.append(n)
        equal_group = (i // size) % equal_every == 0  # no token rewards either: the scalars stay equal
        token_rewards.append([0.0 if equal_group else -0.05 * rng.random() for _ in range(n)])
    return scores, token_rewards, lengths
