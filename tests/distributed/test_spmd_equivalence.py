"""Every algorithm and every loss aggregation mode is sharding-invariant.

The same global batch (rewards, samples, old/reference/engine logprobs) is processed on 1 rank
and split over 2 ranks with real gloo process groups and a real FSDP2 policy. Advantages
(including REINFORCE++'s global whitening), the loss and the full gradients must agree to
rel. 1e-5, with KL, entropy, truncated IS and dual-clip switched on. The token-level estimators
alone, on uneven shards of real gloo ranks, equal one process too.
"""

import math

import numpy as np
import torch
from omegaconf import OmegaConf

from advantage_helpers import TOKEN_ESTIMATORS, estimate, random_batch
from dist_helpers import gathered, run_distributed
from grad_helpers import assert_grads_close, full_grads, update_batch
from launch_helpers import ROOT
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.algorithms import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS, LOSS_AGG_MODES, AdvantageInputs
from distflow.train.batch import TokenBatch
from distflow.config import AlgorithmConfig, DistflowConfig
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.train.update import Updater

GROUP = 4
ALGORITHMS = sorted((ROOT / "recipes" / "algorithm").glob("*.yaml"))


def _algorithm(path) -> AlgorithmConfig:
    node = OmegaConf.to_container(OmegaConf.load(path))
    node = node["algorithm"] if "algorithm" in node else node  # a `_global_` package (ppo also sets critic)
    a = DistflowConfig.from_dict({"algorithm": node}).algorithm
    # the cap and the dual clip are set where this batch's ratios reach them (asserted below)
    a.group_size, a.kl_coef, a.entropy_coef, a.tis_cap = GROUP, 0.05, 0.01, 1.02
    a.dual_clip_c = 1.2 if a.policy_loss == "ppo_clip" else None
    return a


@torch.no_grad()
def _near_current(policy, samples, noise, scale):
    lp = policy.logprobs(TokenBatch.from_samples(samples, 0, torch.device("cpu")))
    return [lp[i, : len(s.response_ids)] + scale * noise[i] for i, s in enumerate(samples)]


def _advantages(a: AlgorithmConfig, rewards, local, noise):
    """[N, R] advantages through the trainer's one estimator signature."""
    global_sum = lambda v: all_reduce(v).tolist()  # noqa: E731
    width = max(len(s.response_ids) for s in local)
    mask = torch.stack([torch.arange(width) < len(s.response_ids) for s in local]).float()
    values = None
    if a.advantage in CRITIC_ESTIMATORS:  # fixed stand-in values (the critic has its own test)
        values = torch.stack([torch.nn.functional.pad(n, (0, width - len(n))) for n in noise]) * mask
    inputs = AdvantageInputs(rewards, torch.zeros_like(mask), mask, values)
    return ADVANTAGE_ESTIMATORS[a.advantage](inputs, a, global_sum)[0]


def _capped(batch, cap) -> float:
    """Tokens whose truncated-IS weight pi_old / pi_engine is cut at the cap (counted independently)."""
    return float(((batch.old_logprobs - batch.sampling_logprobs > math.log(cap)) & batch.loss_mask.bool()).sum())


def _worker(rank, world, model_dir):
    torch.manual_seed(0)
    cfg = fp32_config()
    cfg.optim.micro_batch_size = 3
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    samples, _, noise = fixed_batch(n=8)
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 1.0]])
    per = len(samples) // world
    lo, hi = rank * per, (rank + 1) * per
    local = samples[lo:hi]
    old = _near_current(policy, local, noise[lo:hi], 1.0)
    ref = _near_current(policy, local, noise[lo:hi], -0.5)
    for s, lp in zip(local, _near_current(policy, local, noise[lo:hi], 0.7)):
        s.logprobs = lp.tolist()  # engine sampling logprobs, for truncated IS
    results = {}
    for path in ALGORITHMS:
        cfg.algorithm = _algorithm(path)
        adv = _advantages(cfg.algorithm, rewards.reshape(-1)[lo:hi], local, noise[lo:hi])
        every_rank = gathered([a[: len(s.response_ids)].tolist() for a, s in zip(adv, local)])
        batch = update_batch(local, adv, old, ref)
        for mode in LOSS_AGG_MODES:
            cfg.algorithm.loss_agg_mode = mode
            sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
            grads = full_grads(policy.model)
            policy.optimizer.zero_grad(set_to_none=True)
            fired = [float(all_reduce(sums.dual_clip)), float(all_reduce(_capped(batch, cfg.algorithm.tis_cap)))]
            results[(path.stem, mode)] = (sum(every_rank, []), float(all_reduce(sums.loss)), grads, fired)
    return results


def test_every_algorithm_and_mode_is_sharding_invariant(tiny_model_dir):
    one, two = (run_distributed(_worker, world, tiny_model_dir) for world in (1, 2))
    assert len(one) == len(ALGORITHMS) * len(LOSS_AGG_MODES) and one.keys() == two.keys()
    for key in one:
        (a1, l1, g1, f1), (a2, l2, g2, f2) = one[key], two[key]
        dual, capped = f1
        assert capped > 0 and f1 == f2, (key, f1, f2)  # truncated IS cut some tokens, on both layouts
        assert (dual > 0) == (key[0] not in ("gspo", "cispo")), (key, f1)  # dual clip fired (ppo_clip only)
        assert len(a1) == len(a2) == 8, key
        for x1, x2 in zip(a1, a2):
            torch.testing.assert_close(torch.tensor(x1), torch.tensor(x2), rtol=1e-5, atol=1e-6, msg=str(key))
        assert l1 != 0.0 and abs(l1 - l2) <= 1e-5 * abs(l1), (key, l1, l2)
        assert_grads_close(g1, g2, 1e-5, key)


def _estimators_worker(rank, world):
    from distflow.distributed import all_reduce

    scores, token_rewards, lengths = random_batch(5, 6, 2)
    lo, hi = (0, 8) if rank == 0 else (8, 12)  # uneven shards
    results = {name: estimate(name, scores[lo:hi], token_rewards[lo:hi], lengths[lo:hi], 2, 0.9,
                              lambda v: all_reduce(v).tolist()) for name in TOKEN_ESTIMATORS}
    return gathered(results)


def test_advantages_on_real_gloo_ranks_equal_one_process():
    r0, r1 = run_distributed(_estimators_worker, 2)
    scores, token_rewards, lengths = random_batch(5, 6, 2)
    for name in TOKEN_ESTIMATORS:
        whole = estimate(name, scores, token_rewards, lengths, 2, 0.9)
        parts = [r0[name], r1[name]]
        rows = [p[i] for p in parts for i in range(p.shape[0])]
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(rows[i][:n].numpy(), whole[i, :n].numpy(), rtol=1e-6, atol=1e-7)
        # equal groups are exactly zero on every rank too
        scalar = [s + sum(tr) for s, tr in zip(scores, token_rewards)]
        equal = [g for g in range(0, len(scores), 2) if scalar[g] == scalar[g + 1]]
        assert equal
        for g in equal:
            if name != "reinforce_pp":
                assert all(not rows[i].any() for i in (g, g + 1)), (name, g)
