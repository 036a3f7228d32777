"""Turn generated groups into rewards: decode, build reward calls, run them in the pool."""

from __future__ import annotations

import torch

from distflow.data.prompts import PromptItem
from distflow.rewards.pool import RewardPool
from distflow.rollout.base import Sample

REWARD_FAILURES = ("errors", "timeouts", "invalid")


def score_groups(pool: RewardPool, tokenizer, items: list[PromptItem], samples: list[Sample],
                 group_size: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards as [len(items), group_size] and this batch's failure counts.

    Each call gets (prompt text, completion text, completion ids, item fields); the fields
    always carry the reference as "answer".
    """
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    calls = []
    for i, (sample, text) in enumerate(zip(samples, texts)):
        item = items[i // group_size]
        calls.append((item.prompt_text, text, sample.response_ids, {**item.fields, "answer": item.answer}))
    rewards, stats = pool.score(calls) if calls else ([], {})
    counts = {k: float(stats.get(k, 0)) for k in REWARD_FAILURES}
    return torch.tensor(rewards, dtype=torch.float32).view(-1, group_size), counts
