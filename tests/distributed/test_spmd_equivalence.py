"""Every algorithm and every loss aggregation mode is sharding-invariant.

The same global batch (rewards, samples, old/reference/engine logprobs) is processed on 1 rank
and split over 2 ranks with real gloo process groups and a real FSDP2 policy. Advantages
(including REINFORCE++'s global whitening), the loss and the full gradients must agree to
rel. 1e-5, with KL, entropy, truncated IS and dual-clip switched on. Every rollout-correction mode,
on padded and packed rows, gives the loss of a reference written out here to rel. 1e-6 on both
layouts. The token-level estimators alone, on uneven shards of real gloo ranks, equal one process too.
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
from distflow.algorithms.correction_metrics import HEAD
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
    a.group_size, a.kl_coef, a.entropy_coef = GROUP, 0.05, 0.01
    a.rollout_correction.rollout_is, a.rollout_correction.rollout_is_threshold = "token", 1.02
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
    values = teacher = None
    fixed = torch.stack([torch.nn.functional.pad(n, (0, width - len(n))) for n in noise]) * mask
    if a.advantage in CRITIC_ESTIMATORS:  # fixed stand-in values (the critic has its own test)
        values = fixed
    if a.advantage == "distill":  # a stand-in log pi_student - log pi_teacher (the teacher's own test: test_distill.py)
        teacher = -fixed  # advantages = the old logprobs' noise: negative where the ratio is high, so dual clip fires
    inputs = AdvantageInputs(rewards, torch.zeros_like(mask), mask, values, teacher)
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
            fired = [float(all_reduce(sums.dual_clip)),
                     float(all_reduce(_capped(batch, cfg.algorithm.rollout_correction.rollout_is_threshold)))]
            results[(path.stem, mode)] = (sum(every_rank, []), float(all_reduce(sums.loss)), grads, fired)
    results.update(_correction_cases(cfg, policy, local, rewards.reshape(-1)[lo:hi], old))
    return results


# Rollout corrections on 1 and 2 ranks, padded and packed rows, each against the reference below
CORRECTIONS = {  # the bands sit where this batch's ratios cross them (rho in [0.85, 1.1])
    "token_tis": dict(rollout_is="token", rollout_is_threshold=1.05),
    "seq_tis_normalised": dict(rollout_is="sequence", rollout_is_threshold=1.1, rollout_is_batch_normalize=True),
    "token_tis_normalised": dict(rollout_is="token", rollout_is_threshold=1.05, rollout_is_batch_normalize=True),
    "icepop": dict(rollout_is="token", rollout_is_threshold=5.0, rollout_rs="token", rollout_rs_threshold=1.1,
                   rollout_rs_threshold_lower=0.9),
    "seq_mis": dict(rollout_is="sequence", rollout_is_threshold=1.07, rollout_rs="sequence",
                    rollout_rs_threshold=1.07, rollout_rs_threshold_lower=0.87),
    "geo_veto": dict(rollout_rs="geometric", rollout_rs_threshold=1.03, rollout_token_veto_threshold=0.85),
    "k3": dict(rollout_rs="k3", rollout_rs_threshold=0.003),
    "bypass_geo": dict(bypass_mode=True, rollout_rs="geometric", rollout_rs_threshold=1.03),
}


def _correction_cases(cfg, policy, local, rewards, old):
    from distflow.config import RolloutCorrectionConfig
    from distflow.train.learner import importance_weight_scale

    out = {}
    adv = _advantages(cfg.algorithm, rewards, local, [torch.zeros(len(s.response_ids)) for s in local])
    batch = update_batch(local, adv, old)
    current = policy.logprobs(batch.tokens).detach()
    for name, kw in CORRECTIONS.items():
        for rows in ("off", "on"):
            cfg.algorithm.kl_coef, cfg.algorithm.entropy_coef, cfg.algorithm.dual_clip_c = 0.0, 0.0, None
            cfg.algorithm.policy_loss, cfg.algorithm.loss_agg_mode = "ppo_clip", "token-mean"
            cfg.algorithm.rollout_correction = rc = RolloutCorrectionConfig(**kw)
            cfg.optim.shared_prefix = rows
            b = batch.with_(is_weight_scale=importance_weight_scale(rc, batch.old_logprobs, batch)
                            if rc.rollout_is_batch_normalize else 1.0)
            sums = Updater(cfg, 0).backward_policy(policy, b, list(range(len(b))))
            grads = full_grads(policy.model)
            policy.optimizer.zero_grad(set_to_none=True)
            inputs = [[t[i, : len(s.response_ids)].tolist() for i, s in enumerate(local)]
                      for t in (current, b.old_logprobs, b.sampling_logprobs, b.advantages)]
            out[("rc", name, rows)] = (gathered(inputs), float(all_reduce(sums.loss)), grads,
                                       gathered(sums.correction.values))
    return out


def _reference_loss(kw, rows) -> tuple[float, int]:
    """The token-mean PPO-clip loss with the correction `kw`, written out one token at a time from
    docs/algorithms.md; and how many sequences a rejection zeroed. `rows`: every rank's (current,
    old, engine, advantage) per sample."""
    c = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
         "rollout_rs_threshold_lower": None, "rollout_token_veto_threshold": None, "bypass_mode": False,
         "rollout_is_batch_normalize": False, **kw}
    seqs = [seq for rank in rows for seq in zip(*rank)]
    weights, terms, zeroed = [], [], 0
    for cur, old, eng, adv in seqs:
        prox = cur if c["bypass_mode"] else old
        anchor = eng if c["bypass_mode"] else old
        raw = [p - e for p, e in zip(prox, eng)]
        lr = [min(max(x, -20.0), 20.0) for x in raw]
        rho = [math.exp(x) for x in lr]
        seq = math.exp(min(max(sum(lr), -20.0), 20.0))
        cap = c["rollout_is_threshold"]
        w = [min(r, cap) for r in rho] if c["rollout_is"] == "token" else \
            [min(seq, cap)] * len(rho) if c["rollout_is"] == "sequence" else [1.0] * len(rho)
        upper = c["rollout_rs_threshold"] or cap
        lower = c["rollout_rs_threshold_lower"] if c["rollout_rs_threshold_lower"] is not None else 1 / upper
        keep, keep_seq = [True] * len(rho), True
        if c["rollout_rs"] == "token":
            keep = [lower <= r <= upper for r in rho]
        elif c["rollout_rs"] == "sequence":
            keep_seq = lower <= seq <= upper
        elif c["rollout_rs"] == "geometric":
            keep_seq = lower <= math.exp(sum(lr) / max(len(lr), 1)) <= upper
        elif c["rollout_rs"] == "k3":
            keep_seq = sum(r - x - 1 for r, x in zip(rho, lr)) / max(len(lr), 1) <= upper
        if c["rollout_token_veto_threshold"] and any(math.exp(x) < c["rollout_token_veto_threshold"] for x in raw):
            keep_seq = False
        zeroed += bool(rho) and not keep_seq
        weights.append(w)
        for t, (p, a0, k) in enumerate(zip(cur, anchor, keep)):
            r = math.exp(min(max(p - a0, -20.0), 20.0))
            term = max(-adv[t] * r, -adv[t] * min(max(r, 0.8), 1.2))
            terms.append((len(weights) - 1, t, term * (k and keep_seq)))
    scale = 1.0
    if c["rollout_is_batch_normalize"]:
        flat = [x for w in weights for x in w] if c["rollout_is"] == "token" else [w[0] for w in weights if w]
        scale = len(flat) / sum(flat)
    return sum(weights[i][t] * scale * term for i, t, term in terms) / len(terms), zeroed


def test_every_algorithm_and_mode_is_sharding_invariant(tiny_model_dir):
    one, two = (run_distributed(_worker, world, tiny_model_dir) for world in (1, 2))
    assert one.keys() == two.keys()
    for key in [k for k in one if k[0] == "rc"]:  # the rollout corrections, padded and packed rows
        (rows1, l1, g1, v1), (rows2, l2, g2, v2) = one.pop(key), two.pop(key)
        expect, zeroed = _reference_loss(CORRECTIONS[key[1]], rows1)
        assert abs(l1 - expect) <= 1e-6 * abs(expect) and abs(l2 - expect) <= 1e-6 * abs(expect), (key, l1, l2, expect)
        assert_grads_close(g1, g2, 1e-5, key)
        seqs_masked = sum(v[HEAD.index("seqs_masked")] for v in v2)  # summed over the 2 ranks
        assert seqs_masked == v1[0][HEAD.index("seqs_masked")] == zeroed, (key, seqs_masked, zeroed)
        if "rs" in str(CORRECTIONS[key[1]]) or "veto" in str(CORRECTIONS[key[1]]):
            masked = sum(v[HEAD.index("tokens_masked")] for v in v2)
            assert 0 < masked < sum(v[HEAD.index("tokens")] for v in v2), key  # the band cut some, not all
    assert len(one) == len(ALGORITHMS) * len(LOSS_AGG_MODES)
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
