"""Reward shaping between scoring and the advantage estimator, on the update batch's tokens."""

from __future__ import annotations

import torch

from distflow.algorithms import overlong_penalty, token_kl
from distflow.config import AlgorithmConfig
from distflow.train.batch import TokenBatch


def shape_rewards(rewards: torch.Tensor, tokens: TokenBatch, a: AlgorithmConfig, max_len: int,
                  old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                  resp_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward shaping between scoring and the advantage estimator: (scores [N], token rewards [N, R]).

    - DAPO's soft overlong punishment (algorithm.overlong_buffer_len > 0, against max_len: the
      response length limit) is added to the score; `resp_len`: each sample's response length when
      its rows are not its response (default: the tokens' rows).
    - With algorithm.kl_in_reward, -beta * KL(old || ref) is a reward on every response token
      (verl's kl_in_reward); sequence-level estimators sum it, GAE uses it per token.
    """
    mask = tokens.resp_mask  # on the training device, as everything below: the estimators run there
    scores = rewards.reshape(-1).to(device=mask.device, dtype=torch.float32)
    if a.overlong_buffer_len > 0:
        lengths = tokens.resp_len if resp_len is None else resp_len
        scores = scores + overlong_penalty(lengths.to(device=mask.device, dtype=torch.float32), max_len,
                                           a.overlong_buffer_len, a.overlong_penalty)
    token_rewards = torch.zeros_like(mask)
    if a.kl_coef > 0 and a.kl_in_reward and len(tokens):
        token_rewards = -a.kl_coef * token_kl(old_logprobs, ref_logprobs, mask, a.kl_estimator)
    return scores, token_rewards
