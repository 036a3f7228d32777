"""Advantage estimators in the trainer's signature, against plain-Python references written here.

- Equal groups get exactly 0 from every group-relative estimator, including rewards that are not
  representable in float32 (whose float32 mean is one ulp off, so that the std is exactly 0 and
  (r - mean) / (0 + eps) would magnify the ulp into +-0.06).
- REINFORCE++ works per token, as verl's reinforce_plus_plus: the outcome reward on the last
  token plus per-token rewards (-beta * KL), returns discounted with gamma, whitened over the
  valid tokens of every rank (Bessel's correction counts tokens; empty responses are left out).
- REINFORCE++-baseline: the group-centred scalar spread over the tokens, whitened over tokens.
- A batch split over shards, one of them empty, equals one process (over real gloo ranks:
  distributed/test_spmd_equivalence.py).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from advantage_helpers import TOKEN_ESTIMATORS, cfg, estimate, random_batch
from distflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, local_sum

EPS = 1e-6
GROUP_RELATIVE = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


# ----------------------------------------------------------------------------- references

def ref_std(xs):
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_whiten_tokens(rows):
    flat = [x for row in rows for x in row]
    if not flat:
        return rows
    m, s = sum(flat) / len(flat), ref_std(flat)
    return [[(x - m) / (s + EPS) for x in row] for row in rows]


def ref_returns(score, token_rewards, gamma):
    """r_t = token reward (+ the outcome on the last token); G_t = r_t + gamma G_{t+1}."""
    r = list(token_rewards)
    if r:
        r[-1] += score
    out, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running
        out[t] = running
    return out


def reference(name, scores, token_rewards, lengths, group_size, gamma=1.0):
    """Per-token advantages, one list per sample (len = its response length)."""
    if name == "reinforce_pp":
        return ref_whiten_tokens([ref_returns(s, tr[:n], gamma) for s, tr, n in zip(scores, token_rewards, lengths)])
    scalar = [s + sum(tr[:n]) for s, tr, n in zip(scores, token_rewards, lengths)]
    per_sample = []
    for g in range(0, len(scalar), group_size):
        grp = scalar[g : g + group_size]
        m = sum(grp) / len(grp)
        equal = all(x == grp[0] for x in grp)
        for x in grp:
            if equal:
                per_sample.append(0.0)
            elif name == "grpo":
                per_sample.append((x - m) / (ref_std(grp) + EPS))
            elif name == "drgrpo":
                per_sample.append(x - m)
            elif name == "rloo":
                per_sample.append(x - (sum(grp) - x) / (len(grp) - 1))
            else:  # reinforce_pp_baseline: centred here, whitened over tokens below
                per_sample.append(x - m)
    rows = [[a] * n for a, n in zip(per_sample, lengths)]
    if name == "reinforce_pp_baseline":
        rows = ref_whiten_tokens(rows)
        equal_rows = [all(x == scalar[g] for x in scalar[g : g + group_size])
                      for g in range(0, len(scalar), group_size) for _ in range(group_size)]
        rows = [[0.0] * len(r) if eq else r for r, eq in zip(rows, equal_rows)]
    return rows


def assert_matches(adv, ref, lengths, rtol=1e-5, atol=1e-6):
    assert adv.shape[0] == len(ref) == len(lengths)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(adv[i, :n].double().numpy(), ref[i], rtol=rtol, atol=atol, err_msg=f"row {i}")
        assert not adv[i, n:].any(), f"row {i}: padding must be exactly 0"


# ----------------------------------------------------------------------------- equal groups

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value,size", [(0.7, 3), (0.9, 6), (0.3, 16), (1.0, 2), (-2.5, 5), (1e-8, 4)])
@pytest.mark.parametrize("name", GROUP_RELATIVE)
def test_equal_groups_get_exactly_zero(name, value, size, dtype):
    # a group of equal rewards beside a group with spread, so batch-wide whitening has a scale
    scores = [value] * size + [float(i) for i in range(size)]
    lengths = [1 + (3 * i) % 5 for i in range(2 * size)]
    adv = estimate(name, scores, [[0.0] * n for n in lengths], lengths, size, dtype=dtype)
    assert torch.equal(adv[:size], torch.zeros_like(adv[:size])), adv[:size]
    assert adv[size:].abs().sum() > 0


def test_the_float32_flaw_is_real():
    """What the exact zeros guard against: the naive float32 formula on 0.9 x 6 or 0.3 x 16 is not 0
    (the float32 mean is one ulp off: about 0.06 and 0.03 here)."""
    for value, size in ((0.9, 6), (0.3, 16)):
        r = torch.full((4, size), value)
        naive = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + EPS)
        assert naive.abs().max() > 0.01, (value, size)


# ----------------------------------------------------------------------------- against the references

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", TOKEN_ESTIMATORS)
def test_estimators_match_reference(name, seed):
    size = 4
    scores, token_rewards, lengths = random_batch(seed, 6, size)
    gamma = 0.9 if name == "reinforce_pp" else 1.0
    adv = estimate(name, scores, token_rewards, lengths, size, gamma)
    assert_matches(adv, reference(name, scores, token_rewards, lengths, size, gamma), lengths)


def test_reinforce_pp_kl_in_the_reward_is_per_token():
    """r - beta * sum_{s >= t} KL_s at every token (gamma = 1), not the whole sequence's KL everywhere."""
    scores, kl = [1.0, 0.0, 2.0], [[0.1, 0.2, 0.3], [0.5], [0.0, 0.4]]
    lengths = [3, 1, 2]
    token_rewards = [[-k for k in row] for row in kl]
    adv = estimate("reinforce_pp", scores, token_rewards, lengths, 1)
    returns = [[1.0 - 0.6, 1.0 - 0.5, 1.0 - 0.3], [0.0 - 0.5], [2.0 - 0.4, 2.0 - 0.4]]
    assert_matches(adv, ref_whiten_tokens(returns), lengths)


def test_reinforce_pp_discounts_with_gamma():
    lengths, gamma = [4, 2, 3], 0.5
    adv = estimate("reinforce_pp", [1.0, 2.0, -1.0], [[0.0] * n for n in lengths], lengths, 1, gamma)
    returns = [[0.125, 0.25, 0.5, 1.0], [1.0, 2.0], [-0.25, -0.5, -1.0]]
    assert_matches(adv, ref_whiten_tokens(returns), lengths)
    undiscounted = estimate("reinforce_pp", [1.0, 2.0, -1.0], [[0.0] * n for n in lengths], lengths, 1, 1.0)
    assert not torch.allclose(adv, undiscounted)


def test_token_whitening_differs_from_sample_whitening_by_the_length_factor():
    """Equal lengths L, n samples: token whitening = sample whitening * sqrt((Ln - 1) / (L(n - 1)))."""
    scores, L = [1.0, 0.0, 3.0, 0.5, 2.0], 4
    n = len(scores)
    adv = estimate("reinforce_pp", scores, [[0.0] * L] * n, [L] * n, 1)
    m, s = sum(scores) / n, ref_std(scores)
    factor = math.sqrt((L * n - 1) / (L * (n - 1)))
    for i, x in enumerate(scores):
        np.testing.assert_allclose(adv[i].numpy(), [(x - m) / s * factor] * L, rtol=1e-5)


def test_reinforce_pp_single_token_and_empty_responses():
    # one valid token in the whole batch: no spread, advantage 0 (never NaN); empty responses: nothing
    adv = estimate("reinforce_pp", [3.0, 1.0, 2.0], [[0.0], [], []], [1, 0, 0], 1)
    assert torch.equal(adv, torch.zeros_like(adv))


# ----------------------------------------------------------------------------- sharding

def _gathered_sum(shards_partials):
    return [sum(col) for col in zip(*shards_partials)]


@pytest.mark.parametrize("name", TOKEN_ESTIMATORS)
def test_shards_equal_one_process(name):
    """Uneven shards, one holding no group at all (after dynamic sampling): every shard answers
    from the same global sums, and the pieces equal the whole."""
    size = 4
    scores, token_rewards, lengths = random_batch(11, 5, size)
    whole = estimate(name, scores, token_rewards, lengths, size, 0.95)
    cuts = [(0, 8), (8, 8), (8, 20)]
    partials = []

    def record(v):
        partials.append([float(x) for x in v])
        return v

    for lo, hi in cuts:
        estimate(name, scores[lo:hi], token_rewards[lo:hi], lengths[lo:hi], size, 0.95, record)
    total = _gathered_sum(partials) if partials else []
    pieces = [estimate(name, scores[lo:hi], token_rewards[lo:hi], lengths[lo:hi], size, 0.95,
                       (lambda v: total) if total else local_sum) for lo, hi in cuts]
    for (lo, hi), piece in zip(cuts, pieces):
        for i in range(lo, hi):
            n = lengths[i]
            np.testing.assert_allclose(piece[i - lo, :n].numpy(), whole[i, :n].numpy(), rtol=1e-6, atol=1e-7)
    if name.startswith("reinforce_pp"):  # the reducer really is used: local statistics would differ
        local_only = estimate(name, scores[8:20], token_rewards[8:20], lengths[8:20], size, 0.95)
        assert not torch.allclose(local_only, pieces[2])


# ----------------------------------------------------------------------------- samples of several rows

def _split_rows(seed):
    """6 samples (3 groups of 2), each cut into 1-3 rows of random lengths: (scores, per-sample token
    lists of (token reward, teacher log ratio), the row lengths of each sample)."""
    rng = random.Random(seed)
    scores = [0.5, 0.5, 1.0, 0.0, rng.random(), rng.random()]  # the first group equal (no token rewards)
    cuts = [[rng.randint(0, 4) for _ in range(rng.choice([1, 2, 3]))] for _ in scores]
    # token rewards in 1/64ths: their sums are exact in any order, so both layouts add the same scalar
    tokens = [[(rng.randint(-6, 6) / 64 * (i >= 2), rng.uniform(-1, 1)) for _ in range(sum(c))]
              for i, c in enumerate(cuts)]
    return scores, tokens, cuts


def _inputs(scores, rows, sample_of=None):
    """AdvantageInputs of `rows` (lists of (token reward, teacher log ratio)) padded to one width."""
    width = max([1, *(len(r) for r in rows)])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    tr = torch.tensor([[x for x, _ in r] + [0.0] * (width - len(r)) for r in rows])
    ratio = torch.tensor([[y for _, y in r] + [0.0] * (width - len(r)) for r in rows])
    of = None if sample_of is None else torch.tensor(sample_of)
    return AdvantageInputs(torch.tensor(scores), tr * mask, mask, None, ratio * mask, of), mask


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "distill", "reinforce_pp"])
@pytest.mark.parametrize("seed", range(3))
def test_a_sample_of_several_rows_has_the_advantages_of_its_rows_joined(name, seed):
    """A sample trained as several rows (a harness episode's branches) gets, token for token, the
    advantages it would get as one row holding all their tokens: the group statistics are the samples',
    the token rewards summed over all its rows. (REINFORCE++ with gamma = 1 and no token rewards: every
    token's return is the outcome on either layout.)"""
    scores, tokens, cuts = _split_rows(seed)
    if name == "reinforce_pp":
        tokens = [[(0.0, y) for _, y in t] for t in tokens]
    rows, sample_of = [], []
    for i, (t, c) in enumerate(zip(tokens, cuts)):
        starts = np.cumsum([0, *c])
        rows += [t[a:b] for a, b in zip(starts[:-1], starts[1:])]
        sample_of += [i] * len(c)
    a = cfg(name, 2)
    a.distill_reward_weight = 0.5
    split, split_mask = _inputs(scores, rows, sample_of)
    whole, whole_mask = _inputs(scores, tokens)
    estimator = ADVANTAGE_ESTIMATORS[a.advantage]
    got, expected = estimator(split, a, local_sum)[0], estimator(whole, a, local_sum)[0]
    got_tokens = [[float(got[k, j]) for j in range(len(r))] for k, r in enumerate(rows)]
    joined = [[x for k in range(len(rows)) if sample_of[k] == i for x in got_tokens[k]] for i in range(len(scores))]
    for i, t in enumerate(tokens):
        assert joined[i] == pytest.approx([float(expected[i, j]) for j in range(len(t))], rel=1e-6, abs=1e-7)
    assert all(float(v) == 0.0 for v in got[split_mask == 0])
    if name in GROUP_RELATIVE:  # the equal group: exactly 0 on every row
        assert all(x == 0.0 for k in range(len(rows)) if sample_of[k] < 2 for x in got_tokens[k])
