"""GRPO advantages, the clipped surrogate and loss aggregation against hand-written references.

The references below are deliberately written with plain Python loops / numpy, not by calling
the code under test.
"""

import math

import numpy as np
import pytest
import torch

from distflow.config import AlgorithmConfig
from distflow.algorithms import (
    aggregate_denominator,
    aggregate_numerator,
    ppo_clip_loss,
    group_normalized_advantages,
)


def ref_grpo_advantages(rewards, scale, eps=1e-6):
    out = []
    for group in rewards:
        m = sum(group) / len(group)
        var = sum((r - m) ** 2 for r in group) / (len(group) - 1)
        s = math.sqrt(var)
        out.append([(r - m) / (s + eps) if scale else r - m for r in group])
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_reference(scale):
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]]
    got = group_normalized_advantages(torch.tensor(rewards), scale=scale)
    np.testing.assert_allclose(got.numpy(), ref_grpo_advantages(rewards, scale), rtol=1e-6, atol=1e-6)


def test_all_equal_group_has_zero_advantage_not_nan():
    got = group_normalized_advantages(torch.ones(2, 4))
    assert torch.equal(got, torch.zeros(2, 4))


def test_advantages_reject_flat_input():
    with pytest.raises(ValueError):
        group_normalized_advantages(torch.ones(8))


def ref_clipped(lp, old, adv, lo, hi):
    loss = np.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = math.exp(lp[i, t] - old[i, t])
            unclipped = r * adv[i]
            clipped = min(max(r, 1 - lo), 1 + hi) * adv[i]
            loss[i, t] = -min(unclipped, clipped)
    return loss


def _clip_cfg(low, high):
    return AlgorithmConfig(clip_eps_low=low, clip_eps_high=high)


def test_ppo_clip_matches_reference_and_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=g) * 0.3).requires_grad_()
    old = torch.randn(3, 5, generator=g) * 0.3
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, info = ppo_clip_loss(lp, old, adv, torch.ones(3, 5), _clip_cfg(0.2, 0.28))
    np.testing.assert_allclose(loss.detach().numpy(), ref_clipped(lp.detach().numpy(), old.numpy(), adv.numpy(), 0.2, 0.28), rtol=1e-6)
    # gradient: -A * r where the unclipped term is active, 0 where the clip binds
    loss.sum().backward()
    r = torch.exp(lp.detach() - old)
    a = adv[:, None].expand_as(r)
    active = ~(((r > 1.28) & (a > 0)) | ((r < 0.8) & (a < 0)))
    np.testing.assert_allclose(lp.grad.numpy(), torch.where(active, -a * r, torch.zeros_like(r)).numpy(), rtol=1e-6)
    assert torch.equal(info["clip_high"], (r > 1.28) & (a > 0))
    assert torch.equal(info["clip_low"], (r < 0.8) & (a < 0))


def test_ratio_one_gives_minus_advantage():
    lp = torch.zeros(2, 3)
    loss, _ = ppo_clip_loss(lp, lp, torch.tensor([2.0, -1.0]), torch.ones(2, 3), _clip_cfg(0.2, 0.2))
    assert torch.equal(loss, torch.tensor([[-2.0] * 3, [1.0] * 3]))


def ref_aggregate(loss, mask, mode, max_tokens):
    seqs = []
    for row, m in zip(loss, mask):
        toks = [l for l, k in zip(row, m) if k]
        seqs.append(toks)
    if mode == "token-mean":
        n = sum(len(s) for s in seqs)
        return sum(sum(s) for s in seqs) / n
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / max(len(s), 1) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(s) for s in seqs) / (len(seqs) * max_tokens)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_split_over_shards_equals_whole(mode):
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 7, generator=g)
    lengths = [7, 3, 0, 5, 1, 6]  # includes an empty response
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths])
    expected = ref_aggregate(loss.tolist(), mask.tolist(), mode, 7)
    # whole batch on one shard
    whole = aggregate_numerator(loss, mask, mode, 7) / aggregate_denominator(mask, mode)
    assert float(whole) == pytest.approx(expected, rel=1e-6)
    # three uneven shards: sum of numerators over the summed denominator
    parts = [(0, 1), (1, 4), (4, 6)]
    den = sum(aggregate_denominator(mask[a:b], mode) for a, b in parts)
    num = sum(float(aggregate_numerator(loss[a:b], mask[a:b], mode, 7)) for a, b in parts)
    assert num / den == pytest.approx(expected, rel=1e-6)


def test_unknown_agg_mode_rejected():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_numerator(torch.zeros(1, 1), torch.ones(1, 1), "bogus", 1)


# --- engine/trainer mismatch on the training batch (distflow.algorithms.mismatch) ---

def _mismatch_reference(policy, engine, mask):
    """float64 from the definitions: |diff| of the masked tokens and k3 of KL(engine || policy)."""
    m = mask.numpy().astype(bool)
    pol, eng = policy.double().numpy()[m], engine.double().numpy()[m]
    log_r = pol - eng  # log pi_policy / pi_engine on tokens the engine sampled
    return np.abs(eng - pol), np.exp(log_r) - 1.0 - log_r


def test_mismatch_sums_match_a_float64_reference():
    from distflow.algorithms.mismatch import EDGES, mismatch_sums, percentile

    g = torch.Generator().manual_seed(0)
    engine = -torch.rand(6, 40, generator=g) * 5
    policy = engine + torch.randn(6, 40, generator=g) * torch.logspace(-6, -1, 40)  # spread over decades
    mask = (torch.rand(6, 40, generator=g) > 0.2).float()
    diff, k3 = _mismatch_reference(policy, engine, mask)
    s = mismatch_sums(policy, engine, mask)
    assert s.tokens == mask.sum() == len(diff)
    assert s.abs_sum == pytest.approx(diff.sum(), rel=1e-5) and s.abs_max == pytest.approx(diff.max(), rel=1e-6)
    assert s.kl_sum == pytest.approx(k3.sum(), rel=1e-3, abs=1e-9)
    assert sum(s.hist) == len(diff) and len(s.hist) == len(EDGES) + 1
    exact = float(np.percentile(diff, 99, method="inverted_cdf"))
    assert exact <= percentile(s.hist, 0.99) <= exact * 10 ** 0.1  # the bin's upper edge: at most 26% high
    # two ranks' sums add up to the sums of their tokens together (what the step's all-reduce does)
    top, bottom = mask.clone(), mask.clone()
    top[3:], bottom[:3] = 0, 0
    both = mismatch_sums(policy, engine, top) + mismatch_sums(policy, engine, bottom)
    assert both.hist == s.hist and both.tokens == s.tokens and both.abs_max == s.abs_max
    assert both.abs_sum == pytest.approx(s.abs_sum, rel=1e-6)


def test_mismatch_is_exactly_zero_when_engine_and_policy_agree():
    from distflow.algorithms.mismatch import MismatchSums, mismatch_sums, percentile

    lp = -torch.rand(3, 8)
    s = mismatch_sums(lp, lp.clone(), torch.ones(3, 8))
    assert (s.abs_sum, s.kl_sum, s.abs_max, s.tokens) == (0.0, 0.0, 0.0, 24.0)
    assert percentile(s.hist, 0.99) == 0.0 and s.hist[0] == 24.0
    # nothing trained (an empty rank, everything masked): all zeros, and no NaN downstream
    assert mismatch_sums(lp, lp - 1.0, torch.zeros(3, 8)) == MismatchSums()
    assert percentile(MismatchSums().hist, 0.99) == 0.0
    # masked tokens never count, however far off
    far = lp.clone()
    far[:, 4:] -= 30.0
    mask = torch.ones(3, 8)
    mask[:, 4:] = 0
    assert mismatch_sums(lp, far, mask).abs_max == 0.0
