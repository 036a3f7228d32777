"""The FSDP2 policy's loss and gradients do not depend on how the global batch is sharded.

The same fixed global batch is processed on 1 rank and split over 2 ranks (real gloo process
groups, real FSDP2, fully sharded or replicated); losses and full gradients must agree to rel.
1e-5 for every loss aggregation mode, with and without an active importance ratio.

In bf16 the two cannot be equal: each micro-batch's activations and gradients are rounded to
bf16 (8 significant bits, unit roundoff 2^-9 ~ 2e-3) before the fp32 reduction, and 1 and 2 ranks
cut the batch into micro-batches of other shapes, whose kernels round differently. The bound,
BF16_REL = 3e-2 of each gradient's largest entry, allows ~15 roundoffs; a real sharding fault
(a micro-batch lost or counted twice, a normaliser off by the world size) moves the gradient by
10% or more (one of eight sequences is 12%).
"""

import sys

import pytest
import torch

from dist_helpers import run_distributed
from grad_helpers import assert_grads_close, fixed_batch, full_grads, grad_errors, update_batch
from config_helpers import fp32_config
from distflow.algorithms import LOSS_AGG_MODES
from distflow.train.batch import TokenBatch
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.train.update import Updater


BF16_REL = 3e-2


def _worker(rank, world, model_dir, shard_ranks=-1, with_bf16=False):
    """{(dtype, mode, with_ratio): (global loss, full gradients)}: every aggregation mode in
    float32, and token-mean in bf16 too when asked."""
    results = {}
    for dtype, modes in (("float32", LOSS_AGG_MODES), *((("bfloat16", ("token-mean",)),) if with_bf16 else ())):
        results.update(_losses_and_grads(world, rank, model_dir, shard_ranks, dtype, modes))
    return results


def _losses_and_grads(world, rank, model_dir, shard_ranks, dtype, modes):
    torch.manual_seed(0)
    cfg = fp32_config()
    cfg.model.dtype = dtype
    cfg.optim.micro_batch_size = 3  # micro-batches of uneven size, and unequal counts per rank
    cfg.model.shard_ranks = shard_ranks
    # 2 ranks also split by token budget instead of count: how a batch is cut must not matter either
    cfg.optim.micro_batch_tokens = 40 if world == 2 else 0
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    samples, adv, olds = fixed_batch()
    assert sum(len(s.response_ids) == 0 for s in samples) == 1  # it goes through backward and micro-batching
    per = len(samples) // world
    lo, hi = rank * per, (rank + 1) * per
    results = {}
    for mode in modes:
        for with_ratio in (False, True):
            cfg.algorithm.loss_agg_mode = mode
            # with_ratio: old logprobs near the current ones, so the ratio straddles the clip range
            old = _perturbed_current(policy, samples[lo:hi], olds[lo:hi]) if with_ratio else None
            batch = update_batch(samples[lo:hi], adv[lo:hi], old)
            sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
            grads = full_grads(policy.model)
            policy.optimizer.zero_grad(set_to_none=True)
            results[(dtype, mode, with_ratio)] = (float(all_reduce(sums.loss)), grads)
    return results


@torch.no_grad()
def _perturbed_current(policy, samples, noise):
    lp = policy.logprobs(TokenBatch.from_samples(samples, 0, torch.device("cpu")))
    return [lp[i, : len(s.response_ids)] + noise[i] for i, s in enumerate(samples)]


@pytest.mark.parametrize("shard_ranks", [-1, 1], ids=["fsdp", "replicated"])
def test_sharded_loss_and_gradients_equal_single_process(tiny_model_dir, shard_ranks):
    bf16 = shard_ranks == -1  # once is enough: bf16 rounds the same on either mesh
    one = run_distributed(_worker, 1, tiny_model_dir, -1, bf16)
    two = run_distributed(_worker, 2, tiny_model_dir, shard_ranks, bf16)
    assert one.keys() == two.keys() and any(k[0] == "bfloat16" for k in one) == bf16
    for key in one:
        (l1, g1), (l2, g2) = one[key], two[key]
        rel = BF16_REL if key[0] == "bfloat16" else 1e-5
        assert l1 != 0.0
        assert abs(l1 - l2) <= rel * abs(l1), (key, l1, l2)
        assert_grads_close(g1, g2, rel, key)
        if key[0] == "bfloat16":
            assert max(grad_errors(g1, g2).values()) > 1e-6, "bf16 gave float32's exactness: was it really bf16?"


def _count_replica_all_reduces(rank, world, model_dir, sync):
    """Updater.backward_policy over several micro-batches on a replicated mesh, counting the gradient
    all-reduces across replicas (all_reduce calls made from inside torch's FSDP package, or from
    distflow's bucketed reducer)."""
    cfg = fp32_config()
    cfg.model.shard_ranks, cfg.model.replica_grad_sync, cfg.model.grad_bucket_mib = 1, sync, 0.05
    cfg.optim.micro_batch_size = 1
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    samples, adv, _ = fixed_batch()
    batch = update_batch(samples[rank::world], adv[rank::world])
    calls = []
    real_all_reduce = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        across = torch.distributed.get_world_size(kwargs.get("group")) > 1  # not a one-rank mesh's own group
        if across and any(m in caller for m in ("fsdp", "distflow.train.grad_sync")):
            calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
    finally:
        torch.distributed.all_reduce = real_all_reduce
    return {"calls": calls, "n_params": sum(p.numel() for p in policy.model.parameters())}


@pytest.mark.parametrize("sync", ["bucketed", "fsdp"])
def test_replicated_gradients_cross_ranks_once_per_mini_batch(tiny_model_dir, sync):
    """4 micro-batches per rank, yet every gradient is all-reduced exactly once: accumulation
    stays local until the mini-batch's last backward."""
    out = run_distributed(_count_replica_all_reduces, 2, tiny_model_dir, sync)
    assert out["calls"], "no all-reduce across replicas was seen"
    assert sum(out["calls"]) == out["n_params"], out
