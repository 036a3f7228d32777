"""PPO with a critic: GAE advantages and the clipped value loss against independent references,
the critic's values against a plain forward pass, 1-rank vs 2-rank equality of the critic's
loss and gradients, and a resumable end-to-end run with critic warm-up."""

import math

import numpy as np
import pytest
import torch

from dist_helpers import gathered, run_distributed
from grad_helpers import assert_grads_close, full_grads, update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.algorithms import AdvantageInputs, gae_advantages, local_sum, value_loss
from distflow.train.batch import TokenBatch
from distflow.config import AlgorithmConfig, ConfigError
from distflow.train.critic import Critic
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.train.update import Updater


# ----------------------------------------------------------------------------- GAE estimator

def _reference_gae(rewards, values, lengths, penalty, gamma, lam, eps):
    """Plain-python PPO advantages: reward on the last token, GAE backwards, whiten valid tokens."""
    advs, rets = [], []
    for r, v, n, p in zip(rewards, values, lengths, penalty):
        tok_r = [-p[t] for t in range(n)]
        if n:
            tok_r[-1] += r
        adv, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nxt = v[t + 1] if t + 1 < n else 0.0
            last = tok_r[t] + gamma * nxt - v[t] + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append([adv[t] + v[t] for t in range(n)])
    flat = np.array([x for a in advs for x in a])
    mean, std = flat.mean(), flat.std(ddof=1)
    return [[(x - mean) / (std + eps) for x in a] for a in advs], rets


def test_gae_advantages_match_reference():
    cfg = AlgorithmConfig(gamma=0.9, lam=0.8)
    lengths = [3, 1, 0, 4]  # one empty response: nothing to credit, contributes nothing
    g = torch.Generator().manual_seed(3)
    values = torch.randn(4, 4, generator=g, dtype=torch.float64)
    penalty = torch.rand(4, 4, generator=g, dtype=torch.float64) * 0.1
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    rewards = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)
    adv, ret = gae_advantages(AdvantageInputs(rewards, -penalty * mask, mask, values * mask), cfg, local_sum)
    ref_adv, ref_ret = _reference_gae(rewards.tolist(), values.tolist(), lengths, penalty.tolist(), 0.9, 0.8, cfg.eps)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(adv[i, :n].numpy(), ref_adv[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret[i, :n].numpy(), ref_ret[i], rtol=1e-9)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


# ----------------------------------------------------------------------------- value loss

def test_value_loss_clipping_as_specified():
    old = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    ret = torch.tensor([[1.0, 1.0, -1.0, 9.0]])
    v = torch.tensor([[0.3, 2.0, 0.4, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    loss, info = value_loss(v, old, ret, mask, clip=0.2)
    # token 0: v inside old +- 0.2? no: 0.3 -> clipped 0.2; errors 0.49 vs 0.64: the clipped one is larger
    # token 1: v=2.0 -> clipped 0.2; errors 1.0 vs 0.64: the unclipped one is larger
    # token 2: v=0.4 -> clipped 0.2; errors 1.96 vs 1.44: the unclipped one is larger
    expected = [0.5 * 0.64, 0.5 * 1.0, 0.5 * 1.96, 0.0]
    np.testing.assert_allclose(loss.detach().numpy()[0], expected, rtol=1e-6)
    assert info["clipped"].tolist() == [[True, False, False, False]]
    loss.sum().backward()
    # where the clipped term wins, the value gets no gradient (the clip saturates); else v - R
    np.testing.assert_allclose(v.grad.numpy()[0], [0.0, 1.0, 1.4, 0.0], rtol=1e-6)


def test_value_loss_without_clip_is_half_squared_error():
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 0, 2])[:, None]).float()
    loss, info = value_loss(v, old, ret, mask, clip=None)
    ref = 0.5 * (v - ret) ** 2 * mask
    torch.testing.assert_close(loss, ref)
    assert not info["clipped"].any()


# ----------------------------------------------------------------------------- the critic model

def _critic(model_dir, world, lr=1e-3):
    cfg = fp32_config()
    cfg.critic.enabled, cfg.critic.lr = True, lr
    cfg.algorithm.advantage = "gae"
    cfg.optim.micro_batch_size = 3
    return cfg, Critic(model_dir, cfg.critic, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))


def _values_worker(rank, world, model_dir):
    torch.manual_seed(0)
    cfg, critic = _critic(model_dir, world)
    samples, _, _ = fixed_batch(n=4)
    batch = TokenBatch.from_samples(samples, 0, torch.device("cpu"))
    with torch.no_grad():
        got = critic.values(batch)
        # reference: each sequence alone, no padding; V before response token t is the head's
        # output at the position of the token before it
        ref = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            out = critic.model(input_ids=ids).logits[0, :, 0]
            p = len(s.prompt_ids)
            ref.append(out[p - 1 : p - 1 + len(s.response_ids)])
            critic.model.reshard()
    return {"got": got, "ref": ref, "lens": [len(s.response_ids) for s in samples]}


def test_critic_values_are_the_states_before_each_response_token(tiny_model_dir):
    out = run_distributed(_values_worker, 1, tiny_model_dir)
    for i, n in enumerate(out["lens"]):
        torch.testing.assert_close(out["got"][i, :n], out["ref"][i], rtol=1e-5, atol=1e-5)
        assert torch.all(out["got"][i, n:] == 0)
    assert any(out["got"][i, :n].abs().max() > 1e-4 for i, n in enumerate(out["lens"]) if n)


def _sharding_worker(rank, world, model_dir):
    torch.manual_seed(0)
    cfg, critic = _critic(model_dir, world)
    samples, _, noise = fixed_batch(n=8)
    per = len(samples) // world
    lo, hi = rank * per, (rank + 1) * per
    local = samples[lo:hi]
    rewards = torch.linspace(-1.0, 1.0, 8)[lo:hi]
    tokens = TokenBatch.from_samples(local, 0, torch.device("cpu"))
    updater = Updater(cfg, 0)
    padded, mask = updater.values(critic, updater.plan(tokens)), tokens.resp_mask
    adv, ret = gae_advantages(AdvantageInputs(rewards, torch.zeros_like(mask), mask, padded),
                              AlgorithmConfig(gamma=0.95, lam=0.9), lambda v: all_reduce(v).tolist())
    values = [padded[i, : len(s.response_ids)] for i, s in enumerate(local)]
    # returns below the values: the value head's bias gradient is then a sum of one sign, not a
    # near-cancelling one whose roundoff (summed in another order on 2 ranks) is large beside it
    returns = [ret[i, : len(s.response_ids)] - 0.5 + 0.3 * noise[lo + i] for i, s in enumerate(local)]
    old = [v + 0.05 * noise[lo + i] for i, v in enumerate(values)]  # puts some tokens past the clip
    batch = update_batch(local, values=old, returns=returns)
    cfg.critic.value_clip = 0.02
    results = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg.algorithm.loss_agg_mode = mode
        sums = Updater(cfg, 0).backward_value(critic, batch, list(range(len(batch))))
        grads = full_grads(critic.model)
        critic.optimizer.zero_grad(set_to_none=True)
        results[mode] = (float(all_reduce(sums.value_loss)), float(all_reduce(sums.value_clipped)), grads)
    every_rank = gathered([a[: len(s.response_ids)].tolist() for a, s in zip(adv, local)])
    return {"adv": sum(every_rank, []), "results": results}


def test_critic_loss_gradients_and_advantages_are_sharding_invariant(tiny_model_dir):
    one, two = (run_distributed(_sharding_worker, world, tiny_model_dir) for world in (1, 2))
    for a1, a2 in zip(one["adv"], two["adv"]):
        np.testing.assert_allclose(a1, a2, rtol=1e-5, atol=1e-6)
    for mode, (l1, c1, g1) in one["results"].items():
        l2, c2, g2 = two["results"][mode]
        assert l1 > 0 and math.isclose(l1, l2, rel_tol=1e-5), (mode, l1, l2)
        assert c1 == c2 and c1 > 0, (mode, c1, c2)  # the clip is active, and identically so
        assert_grads_close(g1, g2, 1e-5, mode)


# ----------------------------------------------------------------------------- config and runs

@pytest.mark.parametrize("overrides, match", [
    ({"value_clip": 0.0}, "critic.value_clip must be > 0"),
    ({"lam": 1.5}, "algorithm.gamma and lam must be in"),
])
def test_critic_config_errors(overrides, match):
    cfg = fp32_config()
    cfg.task.path = "data.jsonl"
    cfg.algorithm.advantage = "gae"  # the estimator that needs values: the critic follows from it
    cfg.algorithm.lam = overrides.get("lam", 1.0)
    cfg.critic.value_clip = overrides.get("value_clip", 0.5)
    assert cfg.has_critic
    with pytest.raises(ConfigError, match=match):
        cfg.validate()
    cfg.algorithm.advantage, cfg.algorithm.lam = "grpo", 1.0  # no critic: its settings are not checked
    assert not cfg.has_critic
    cfg.validate()
