"""The algorithm suite (advantage estimators, policy losses, KL, DAPO helpers, config checks)
against independent references written here with plain Python loops / math, on hand-built tensors.
"""

import glob
import math
import os

import numpy as np
import pytest

from config_helpers import compose
import torch

from distflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_ESTIMATORS,
    SEQUENCE_ESTIMATORS,
    AdvantageInputs,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_denominator,
    aggregate_numerator,
    compute_token_loss,
    dynamic_sampling_keep,
    entropy_from_logits,
    gae,
    kl_penalty,
    local_sum,
    overlong_penalty,
    sequence_kl,
)
from distflow.config import AlgorithmConfig, ConfigError, DistflowConfig, TaskConfig

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "algorithm")
EPS = 1e-6


def cfg_with(**kw) -> AlgorithmConfig:
    """An algorithm section with these keys set (rollout_correction's as rc_<key>)."""
    cfg = AlgorithmConfig()
    for k, v in kw.items():
        target, k = (cfg.rollout_correction, k[3:]) if k.startswith("rc_") else (cfg, k)
        assert hasattr(target, k), k
        setattr(target, k, v)
    return cfg


# ----------------------------------------------------------------------------- references

def ref_mean(xs):
    return sum(xs) / len(xs)


def ref_std_unbiased(xs):
    if len(xs) < 2:
        return 0.0
    m = ref_mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo(rewards, scale):
    out = []
    for g in rewards:
        m, s = ref_mean(g), ref_std_unbiased(g)
        out.append([(r - m) / (s + EPS) if scale else r - m for r in g])
    return out


def ref_rloo(rewards):
    return [[r - (sum(g) - r) / (len(g) - 1) for r in g] for g in rewards]


# REINFORCE++ and its baseline variant work per token: tests/test_advantages.py.
REF_ESTIMATORS = {
    "grpo": lambda r: ref_grpo(r, True),
    "rloo": ref_rloo,
}

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0], [0.2, -1.0, 0.7, 0.1]]


# ----------------------------------------------------------------------------- advantages

@pytest.mark.parametrize("name", sorted(REF_ESTIMATORS))
def test_estimator_matches_reference(name):
    got = SEQUENCE_ESTIMATORS[name](torch.tensor(REWARDS), cfg_with(), local_sum)
    assert got.shape == (4, 4) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), REF_ESTIMATORS[name](REWARDS), rtol=1e-5, atol=1e-6)


def test_drgrpo_is_grpo_without_scaling():
    got = SEQUENCE_ESTIMATORS["grpo"](torch.tensor(REWARDS), cfg_with(scale_rewards=False), local_sum)
    np.testing.assert_allclose(got.numpy(), ref_grpo(REWARDS, False), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(REF_ESTIMATORS))
def test_all_equal_rewards_give_zero_advantages(name):
    got = SEQUENCE_ESTIMATORS[name](torch.full((3, 4), 0.7), cfg_with(), local_sum)
    assert torch.equal(got, torch.zeros(3, 4))  # exactly: see tests/test_advantages.py


def test_rloo_is_scaled_group_centering():
    r = torch.tensor(REWARDS)
    got = SEQUENCE_ESTIMATORS["rloo"](r, cfg_with(), local_sum)
    assert torch.allclose(got, 4 / 3 * (r - r.mean(1, keepdim=True)), atol=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        SEQUENCE_ESTIMATORS["rloo"](torch.ones(3, 1), cfg_with(), local_sum)


@pytest.mark.parametrize("name", sorted(SEQUENCE_ESTIMATORS))
def test_estimator_rejects_flat_input(name):
    with pytest.raises(ValueError):
        SEQUENCE_ESTIMATORS[name](torch.ones(8), cfg_with(), local_sum)


@pytest.mark.parametrize("name", sorted(SEQUENCE_ESTIMATORS))
def test_sequence_estimator_in_the_common_signature(name):
    """The trainer's signature: scalar = score + sum of token rewards, spread over valid tokens."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 3, (8,), generator=g).float()
    lengths = [3, 0, 2, 4, 1, 4, 2, 3]  # one empty response
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths])
    token_rewards = torch.randn(8, 4, generator=g) * 0.1 * mask
    adv, returns = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(scores, token_rewards, mask), cfg_with(), local_sum)
    assert returns is None
    scalar = [float(scores[i]) + sum(float(token_rewards[i, t]) for t in range(n)) for i, n in enumerate(lengths)]
    ref = SEQUENCE_ESTIMATORS[name](torch.tensor(scalar).view(2, 4), cfg_with(), local_sum).reshape(-1)
    for i, n in enumerate(lengths):
        assert adv[i, :n].tolist() == [float(ref[i])] * n and not adv[i, n:].any()


# ----------------------------------------------------------------------------- GAE

def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 9.9]])  # 9.9 sits on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    gl = 0.9 * 0.8
    # row 0: deltas 0.3 (t=2), 0+0.9*0.7-0.6=0.03 (t=1), 0+0.9*0.6-0.5=0.04 (t=0)
    a2 = 0.3
    a1 = 0.03 + gl * a2
    a0 = 0.04 + gl * a1
    # row 1: t=1 is the last valid token: delta 2-0.2=1.8; t=0: 0.9*0.2-0.1=0.08
    b1 = 1.8
    b0 = 0.08 + gl * b1
    np.testing.assert_allclose(adv.numpy(), [[a0, a1, a2], [b0, b1, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret.numpy(), [[a0 + 0.5, a1 + 0.6, a2 + 0.7], [b0 + 0.1, b1 + 0.2, 0.0]], rtol=1e-6)
    assert abs(a0 - 0.21712) < 1e-9 and abs(b0 - 1.376) < 1e-9


def test_gae_gamma_lam_one_is_reward_to_go_minus_value_and_skips_holes():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.5]])
    values = torch.tensor([[0.3, 0.2, 0.1, 0.4]])
    mask = torch.tensor([[1, 0, 1, 1]])  # a hole at t=1 (e.g. a tool observation)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    rtg = [1.0 + 2.0 + 0.5, 0.0, 2.5, 0.5]
    np.testing.assert_allclose(ret.numpy(), [rtg], rtol=1e-6)
    np.testing.assert_allclose(adv.numpy(), [[rtg[0] - 0.3, 0.0, rtg[2] - 0.1, rtg[3] - 0.4]], rtol=1e-6)
    empty_adv, empty_ret = gae(rewards, values, torch.zeros(1, 4), 0.9, 0.9)
    assert torch.equal(empty_adv, torch.zeros(1, 4)) and torch.equal(empty_ret, torch.zeros(1, 4))


# ----------------------------------------------------------------------------- policy losses

# log-ratios chosen to hit every branch: inside the clip range, above/below it, beyond dual-clip c=3
DELTAS = [
    [0.0, 0.1, 0.5, -0.5, 1.5, 0.0],  # A > 0
    [0.05, 0.5, -0.5, 1.5, -0.1, 0.0],  # A < 0; 1.5 -> ratio 4.48 > c
    [0.3, -0.3, 0.0, 0.0, 0.0, 0.0],  # A = 0, short
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # empty response
    [-1.2, 0.02, 0.2, 0.0, 0.0, 0.0],  # A > 0, 3 tokens
]
ADV = [1.5, -2.0, 0.0, 0.7, 0.4]
LENS = [6, 5, 2, 0, 3]


def loss_inputs():
    g = torch.Generator().manual_seed(5)
    old = torch.randn(5, 6, generator=g, dtype=torch.float64) - 1.0
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in LENS], dtype=torch.float64)
    lp = old + torch.tensor(DELTAS, dtype=torch.float64)
    # garbage on padding (huge / -inf logprobs) must not leak into values or gradients
    lp = torch.where(mask.bool(), lp, torch.tensor(50.0, dtype=torch.float64))
    lp[3, 0] = -math.inf
    return lp.requires_grad_(), old, torch.tensor(ADV, dtype=torch.float64), mask


def ref_ppo(lp, old, adv, mask, lo, hi, c):
    """Per-token value and d(value)/d(logp) of the (dual-)clipped PPO loss."""
    val, grad = np.zeros(lp.shape), np.zeros(lp.shape)
    flags = {"clip_low": set(), "clip_high": set(), "dual_clip": set()}
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i][t]:
                continue
            a, r = adv[i], math.exp(lp[i][t] - old[i][t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            v, g = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if c is not None and a < 0 and v > -c * a:
                v, g = -c * a, 0.0
                flags["dual_clip"].add((i, t))
            val[i][t], grad[i][t] = v, g
            if r < 1 - lo and a < 0:
                flags["clip_low"].add((i, t))
            if r > 1 + hi and a > 0:
                flags["clip_high"].add((i, t))
    return val, grad, flags


def _np(x):
    return x.detach().numpy()


def _flag_set(mask_tensor):
    return {tuple(ix) for ix in torch.nonzero(mask_tensor).tolist()}


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_values_gradients_and_flags(dual, eps):
    lp, old, adv, mask = loss_inputs()
    cfg = cfg_with(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip_c=dual)
    loss, info = POLICY_LOSSES["ppo_clip"](lp, old, adv, mask, cfg)
    val, grad, flags = ref_ppo(_np(lp), _np(old), ADV, _np(mask), eps[0], eps[1], dual)
    np.testing.assert_allclose(_np(loss), val, rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-12, atol=1e-12)
    for k in ("clip_low", "clip_high", "dual_clip"):
        assert info[k].dtype == torch.bool and _flag_set(info[k]) == flags[k], k
    assert flags["clip_high"] and flags["clip_low"] and (flags["dual_clip"] or dual is None)


def test_ppo_clip_token_level_advantages_equal_broadcast():
    lp, old, adv, mask = loss_inputs()
    cfg = cfg_with(dual_clip_c=3.0)
    a, _ = POLICY_LOSSES["ppo_clip"](lp, old, adv, mask, cfg)
    b, _ = POLICY_LOSSES["ppo_clip"](lp, old, adv[:, None].expand(5, 6).clone(), mask, cfg)
    assert torch.equal(a, b)


def test_ppo_clip_finite_difference_gradient():
    lp, old, adv, mask = loss_inputs()
    cfg = cfg_with(clip_eps_high=0.28, dual_clip_c=3.0)
    loss, _ = POLICY_LOSSES["ppo_clip"](lp, old, adv, mask, cfg)
    loss.sum().backward()
    h = 1e-6
    for i, t in [(0, 1), (0, 4), (1, 1), (1, 3), (4, 0), (4, 2)]:
        plus, minus = lp.detach().clone(), lp.detach().clone()
        plus[i, t] += h
        minus[i, t] -= h
        fd = (POLICY_LOSSES["ppo_clip"](plus, old, adv, mask, cfg)[0].sum()
              - POLICY_LOSSES["ppo_clip"](minus, old, adv, mask, cfg)[0].sum()) / (2 * h)
        assert float(fd) == pytest.approx(float(lp.grad[i, t]), abs=1e-6)


def ref_gspo(lp, old, adv, mask, lo, hi):
    """The paper's sequence objective -min(s A, clip(s) A), s = exp(mean_t(lp - old)); d/d lp_t."""
    vals, grads, ratios = [], np.zeros(lp.shape), np.zeros(lp.shape)
    for i in range(lp.shape[0]):
        idx = [t for t in range(lp.shape[1]) if mask[i][t]]
        if not idx:
            vals.append(0.0)
            continue
        s = math.exp(sum(lp[i][t] - old[i][t] for t in idx) / len(idx))
        a = adv[i]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        vals.append(max(unclipped, clipped))
        for t in idx:
            ratios[i][t] = s
            grads[i][t] = -a * s / len(idx) if unclipped >= clipped else 0.0
    return vals, grads, ratios


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_sequence_objective(eps):
    lp, old, adv, mask = loss_inputs()
    cfg = cfg_with(policy_loss="gspo", clip_eps_low=eps[0], clip_eps_high=eps[1], loss_agg_mode="seq-mean-token-mean")
    loss, info = POLICY_LOSSES["gspo"](lp, old, adv, mask, cfg)
    vals, grads, ratios = ref_gspo(_np(lp), _np(old), ADV, _np(mask), *eps)
    # each valid token carries its sequence's loss; padding is 0
    for i, n in enumerate(LENS):
        np.testing.assert_allclose(_np(loss)[i, :n], [vals[i]] * n, rtol=1e-12)
        assert not _np(loss)[i, n:].any()
    np.testing.assert_allclose(_np(info["ratio"]) * _np(mask), ratios, rtol=1e-12)
    # seq-mean-token-mean aggregation gives the paper's objective and its gradient
    agg = aggregate_numerator(loss, mask, cfg.loss_agg_mode, 6) / aggregate_denominator(mask, cfg.loss_agg_mode)
    assert float(agg.detach()) == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    agg.backward()
    np.testing.assert_allclose(lp.grad.numpy(), grads / len(vals), rtol=1e-10, atol=1e-14)


def test_gspo_clip_is_per_sequence():
    lp, old, adv, mask = loss_inputs()
    _, info = POLICY_LOSSES["gspo"](lp, old, adv, mask, cfg_with(clip_eps_low=3e-4, clip_eps_high=4e-4))
    for i, n in enumerate(LENS):
        for k in ("clip_low", "clip_high"):
            row = info[k][i, :n]
            assert bool(row.all()) or not bool(row.any())  # all tokens of a sequence alike
    # row 0: mean log-ratio 0.27 with A > 0 -> every token clipped high; row 1 (A < 0, s > 1) is not clipped
    assert info["clip_high"][0].all() and not info["clip_high"][1:].any() and not info["clip_low"].any()


def ref_cispo(lp, old, adv, mask, hi):
    val, grad = np.zeros(lp.shape), np.zeros(lp.shape)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i][t]:
                w = min(math.exp(lp[i][t] - old[i][t]), 1 + hi)
                val[i][t] = -w * adv[i] * lp[i][t]
                grad[i][t] = -w * adv[i]
    return val, grad


def test_cispo_values_gradients_and_no_lower_bound():
    lp, old, adv, mask = loss_inputs()
    cfg = cfg_with(policy_loss="cispo", clip_eps_low=0.2, clip_eps_high=0.28)
    loss, info = POLICY_LOSSES["cispo"](lp, old, adv, mask, cfg)
    val, grad = ref_cispo(_np(lp), _np(old), ADV, _np(mask), 0.28)
    np.testing.assert_allclose(_np(loss), val, rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-12, atol=1e-12)
    # token (4, 0) has ratio exp(-1.2) = 0.30 < 1 - eps_low and still gets its full gradient
    assert float(lp.grad[4, 0]) == pytest.approx(-math.exp(-1.2) * ADV[4], rel=1e-12)
    # every token above the cap is flagged, whatever the sign of A; nothing is flagged low
    r = torch.exp(lp.detach() - old)
    assert _flag_set(info["clip_high"]) == _flag_set((r > 1.28) & mask.bool())
    assert not info["clip_low"].any() and not info["dual_clip"].any()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_losses_ignore_padding_and_empty_rows(name):
    lp, old, adv, mask = loss_inputs()
    loss, info = POLICY_LOSSES[name](lp, old, adv, mask, cfg_with(dual_clip_c=3.0))
    assert torch.isfinite(loss).all()
    assert not loss[mask == 0].any()
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all() and not lp.grad[mask == 0].any()
    assert not lp.grad[3].any()  # the empty response contributes nothing
    assert set(info) == {"ratio", "clip_low", "clip_high", "dual_clip"}
    for k in ("clip_low", "clip_high", "dual_clip"):
        assert not info[k][mask == 0].any()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_gradient_is_minus_advantage(name):
    """At ratio 1 every loss has the REINFORCE gradient -A per token (before aggregation)."""
    lp = torch.randn(2, 3, dtype=torch.float64).requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    cfg = cfg_with(clip_eps_low=3e-4, clip_eps_high=4e-4)
    loss, _ = POLICY_LOSSES[name](lp, lp.detach(), adv, torch.ones(2, 3), cfg)
    loss.sum().backward()
    assert torch.allclose(lp.grad, -adv[:, None].expand(2, 3))


# ----------------------------------------------------------------------------- TIS, KL, entropy

def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d, 1.0
    if kind == "k2":
        return 0.5 * d * d, d
    x = max(min(ref - lp, 20.0), -20.0)
    v = math.exp(x) - x - 1
    return max(min(v, 10.0), -10.0), (1.0 - math.exp(ref - lp)) if abs(ref - lp) < 20 and v < 10 else 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_values_and_gradients(kind):
    lp_vals = [[-1.0, -0.2, -3.0, -0.01], [-2.0, -1.0, -0.5, -30.0]]
    ref_vals = [[-1.0, -0.5, -2.0, -0.02], [-1.0, -4.0, -0.4, -1.0]]
    lp = torch.tensor(lp_vals, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(ref_vals, dtype=torch.float64)
    out = kl_penalty(lp, ref, kind)
    out.sum().backward()
    kl = out.detach()
    for i in range(2):
        for t in range(4):
            v, g = ref_kl(lp_vals[i][t], ref_vals[i][t], kind)
            assert float(kl[i, t]) == pytest.approx(v, rel=1e-10, abs=1e-12), (i, t)
            assert float(lp.grad[i, t]) == pytest.approx(g, rel=1e-10, abs=1e-12), (i, t)
    assert kl[0, 0] == 0
    if kind == "k3":
        assert (kl >= 0).all() and float(kl[1, 3]) == 10.0  # clamped like verl
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k9")


def test_sequence_kl_sums_valid_tokens():
    lp = torch.tensor([[-1.0, -2.0, 7.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -math.inf], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    got = sequence_kl(lp, ref, mask, "k2")
    np.testing.assert_allclose(got.numpy(), [0.5 * 0.25 + 0.5 * 1.0, 0.0], rtol=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, -5.0, 2.0]],
                           [[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, -1.0, 0.0]]])
    got = entropy_from_logits(logits)
    ref = np.zeros((2, 2))
    for i in range(2):
        for t in range(2):
            row = logits[i, t].tolist()
            m = max(row)
            z = sum(math.exp(x - m) for x in row)
            ref[i, t] = -sum((math.exp(x - m) / z) * ((x - m) - math.log(z)) for x in row)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    assert float(got[0, 0]) == pytest.approx(math.log(4))


# ----------------------------------------------------------------------------- composed loss

def test_compute_token_loss_composes_terms():
    lp, old, adv, mask = loss_inputs()
    g = torch.Generator().manual_seed(9)
    eng = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    ent = torch.rand(old.shape, generator=g, dtype=torch.float64)
    cfg = cfg_with(rc_rollout_is="token", rc_rollout_is_threshold=1.5, kl_coef=0.1, kl_estimator="k3",
                   entropy_coef=0.01)
    loss, info = compute_token_loss(lp, old, adv, mask, cfg, engine_logp=eng, ref_logp=ref, entropy=ent)
    pg, _ = POLICY_LOSSES["ppo_clip"](lp, old, adv, mask, cfg)
    m = mask.bool()
    kl = torch.where(m, kl_penalty(lp, ref, "k3"), 0)
    tis = torch.where(m, torch.exp(old - eng).clamp(max=1.5), 1.0)  # truncated IS, written out
    expect = pg * tis + 0.1 * kl - 0.01 * ent * mask
    assert torch.allclose(loss, expect) and not loss[~m].any()
    assert {"correction", "kl", "entropy"} <= set(info)
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()
    # kl_in_reward: no KL term in the loss; and missing inputs are reported
    plain, _ = compute_token_loss(lp.detach(), old, adv, mask, cfg_with(kl_coef=0.1, kl_in_reward=True))
    assert torch.equal(plain, POLICY_LOSSES["ppo_clip"](lp.detach(), old, adv, mask, cfg_with())[0])
    for kw in ({"rc_rollout_is": "token"}, {"rc_bypass_mode": True}, {"kl_coef": 0.1}, {"entropy_coef": 0.01}):
        with pytest.raises(ValueError):
            compute_token_loss(lp.detach(), old, adv, mask, cfg_with(**kw))
    # kl_metric at kl_coef = 0: the KL to the reference is measured, the loss is exactly the plain one
    measured, info = compute_token_loss(lp.detach(), old, adv, mask, cfg_with(kl_metric=True), ref_logp=ref)
    assert torch.equal(measured, POLICY_LOSSES["ppo_clip"](lp.detach(), old, adv, mask, cfg_with())[0])
    assert torch.allclose(info["kl"], kl) and cfg_with(kl_metric=True).needs_reference
    assert not cfg_with().needs_reference and cfg_with(kl_coef=0.1).needs_reference


# ----------------------------------------------------------------------------- DAPO helpers

def test_dynamic_sampling_keep():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.30001]])
    ref = [len(set(g)) > 1 for g in rewards.tolist()]
    assert dynamic_sampling_keep(rewards).tolist() == ref == [False, True, False, True]
    assert dynamic_sampling_keep(torch.zeros(0, 4)).tolist() == []


def test_overlong_penalty():
    lens = [0, 10, 12, 13, 14, 16, 20]
    got = overlong_penalty(torch.tensor(lens), max_new_tokens=16, buffer_len=4, penalty=0.5)
    ref = []
    for n in lens:
        if n <= 12:
            ref.append(0.0)
        elif n <= 16:
            ref.append(-(n - 12) / 4 * 0.5)
        else:
            ref.append(-0.5)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6)
    assert overlong_penalty([5, 16], 16, 0, 1.0).tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- config checks

def validate_algorithm(algorithm: AlgorithmConfig) -> None:
    """The config's own validation, with this algorithm section and a task that has data."""
    DistflowConfig(algorithm=algorithm, task=TaskConfig(path="data.jsonl")).validate()


def test_default_config_is_valid():
    validate_algorithm(AlgorithmConfig())
    validate_algorithm(cfg_with(advantage="reinforce_pp", group_size=1))  # legal without a group


@pytest.mark.parametrize("kw, match", [
    ({"advantage": "ppo"}, "algorithm.advantage must be one of grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, "
                           "distill; got 'ppo'"),
    ({"policy_loss": "trpo"}, "algorithm.policy_loss must be one of"),
    ({"kl_estimator": "k4"}, "algorithm.kl_estimator must be one of"),
    ({"loss_agg_mode": "mean"}, "algorithm.loss_agg_mode must be one of"),
    ({"group_size": 1}, "group-relative and needs group_size >= 2"),
    ({"advantage": "rloo", "group_size": 1}, "group-relative"),
    ({"advantage": "reinforce_pp_baseline", "group_size": 1}, "group-relative"),
    ({"advantage": "reinforce_pp", "group_size": 0}, "group_size must be >= 1"),
    ({"advantage": "reinforce_pp", "group_size": 1, "dynamic_sampling": True}, "dynamic_sampling"),
    ({"clip_eps_low": 0.3, "clip_eps_high": 0.2}, "clip_eps_low <= clip_eps_high"),
    ({"clip_eps_low": -0.1}, "clip_eps_low"),
    ({"kl_coef": -0.01}, "kl_coef must be >= 0"),
    ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1"),
    ({"dual_clip_c": 0.5}, "dual_clip_c"),
    ({"rc_rollout_is_threshold": 0.0}, "rollout_is_threshold must be > 0"),
    ({"rc_rollout_is": "token", "rc_bypass_mode": True}, "already is the importance weight"),
    ({"rc_rollout_is_batch_normalize": True}, "rollout_is_batch_normalize needs rollout_is"),
    ({"rc_rollout_token_veto_threshold": 1.5}, "veto_threshold must be in"),
    ({"rc_rollout_rs": "token", "rc_rollout_rs_threshold": 0.5}, "0 <= lower < upper"),
    ({"rc_rollout_rs": "geometric", "rc_rollout_rs_threshold": 1.001, "rc_rollout_rs_threshold_lower": -1.0},
     "rejection band"),
    ({"max_sampling_rounds": 0}, "max_sampling_rounds must be >= 1"),
    ({"overlong_buffer_len": -1}, "overlong_buffer_len"),
    ({"overlong_penalty": -1.0}, "overlong_penalty"),
    ({"eps": 0.0}, "eps must be > 0"),
])
def test_validate_algorithm_rejects(kw, match):
    with pytest.raises(ConfigError, match=match) as exc:
        validate_algorithm(cfg_with(**kw))
    assert "\n" not in str(exc.value)


def test_registries_cover_config_names():
    """The function tables and the config's choices name the same things, both ways."""
    from typing import get_args

    from distflow.config.algorithm import Advantage, KLEstimator, LossAggMode, PolicyLoss

    assert set(SEQUENCE_ESTIMATORS) == {"grpo", "rloo"}
    assert set(ADVANTAGE_ESTIMATORS) == set(get_args(Advantage)) == {"grpo", "rloo", "reinforce_pp",
                                                                     "reinforce_pp_baseline", "gae", "distill"}
    assert set(CRITIC_ESTIMATORS) == {"gae"}
    assert set(POLICY_LOSSES) == set(get_args(PolicyLoss)) == {"ppo_clip", "gspo", "cispo"}
    assert set(KL_ESTIMATORS) == set(get_args(KLEstimator)) == {"k1", "k2", "k3"}
    assert LOSS_AGG_MODES == get_args(LossAggMode) and "token-mean" in LOSS_AGG_MODES


RECIPE_FILES = sorted(glob.glob(os.path.join(RECIPES, "*.yaml")))


def test_expected_recipes_exist():
    names = {os.path.splitext(os.path.basename(p))[0] for p in RECIPE_FILES}
    assert names >= {"grpo", "drgrpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"}


@pytest.mark.parametrize("path", RECIPE_FILES, ids=os.path.basename)
def test_recipe_loads_and_validates(path):
    name = os.path.splitext(os.path.basename(path))[0]
    cfg = compose([f"algorithm={name}", *(["teacher.path=tiny"] if name == "distill" else [])])
    assert cfg.algorithm.name == name
    assert cfg.has_critic == (name == "ppo")  # the critic follows from the estimator
    cfg.validate()


# ----------------------------------------------------------------------------- micro-batch planning

def test_plan_micro_batches_groups_similar_lengths():
    from distflow.train.update import plan_micro_batches

    lengths = [50, 3, 40, 4, 45, 5, 200]
    by_count = plan_micro_batches(lengths, size=3)
    assert by_count == [[1, 3, 5], [2, 4, 0], [6]]  # sorted by length, then cut every 3
    by_tokens = plan_micro_batches(lengths, size=3, token_budget=120)
    # padded size (count x longest) within 120; the 200-token sequence alone
    assert by_tokens == [[1, 3, 5], [2, 4], [0], [6]]
    for plan in (by_count, by_tokens):
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 120 for mb in by_tokens)
    assert plan_micro_batches([], size=4) == [] and plan_micro_batches([], 4, 100) == []
