"""Turn generated groups into rewards (decode, build reward calls, run them in the pool), and
count what failed."""

from __future__ import annotations

import logging

import torch

from distflow.tasks.prompts import PromptItem
from distflow.tasks.rewards.pool import RewardPool
from distflow.sample import Sample

log = logging.getLogger("distflow")
REWARD_FAILURES = ("errors", "timeouts", "invalid")


def score_groups(pool: RewardPool, tokenizer, items: list[PromptItem], samples: list[Sample],
                 group_size: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards as [len(items), group_size] and this batch's failure counts.

    Each call gets (prompt text, completion text, completion ids, item fields); the fields
    always carry the reference as "answer". A multi-turn episode's completion is the model's
    final turn (its answer), its ids are every generated token (no observation), and the fields
    add "transcript" (all turns and observations, as messages); the environment's step rewards
    are added to what the task's reward gives. A reward beyond float32's range (finite in
    float64) counts as invalid and scores 0.0, as the pool's invalid rewards do.
    """
    texts = tokenizer.batch_decode([s.response_ids for s in samples if s.episode is None], skip_special_tokens=True)
    single = iter(texts)
    calls = []
    for i, sample in enumerate(samples):
        item = items[i // group_size]
        fields = {**item.fields, "answer": item.answer}
        if sample.episode is None:
            calls.append((item.prompt_text, next(single), sample.response_ids, fields))
            continue
        generated = [t for t, m in zip(sample.response_ids, sample.mask) if m]
        calls.append((item.prompt_text, sample.episode.final_text, generated,
                      {**fields, "transcript": sample.episode.transcript}))
    rewards, stats = pool.score(calls) if calls else ([], {})
    rewards = [r + (s.episode.env_reward if s.episode else 0.0) for r, s in zip(rewards, samples)]
    counts = {k: float(stats.get(k, 0)) for k in REWARD_FAILURES}
    scores = torch.tensor(rewards, dtype=torch.float64).to(torch.float32)
    overflow = ~torch.isfinite(scores)  # finite in float64 (1e300, or a sum past its range), not in float32
    if overflow.any():
        counts["invalid"] += float(overflow.sum())
        if not _warned:
            _warned.append(True)
            log.warning("a reward of %r is beyond float32's range (its advantage would be inf or nan); scored 0.0 "
                        "and counted as invalid (logged once, later ones only counted)",
                        rewards[int(overflow.nonzero()[0])])
        scores[overflow] = 0.0  # as the pool scores any invalid reward
    return scores.view(-1, group_size), counts


_warned: list[bool] = []  # the overflow warning is logged once per process
