"""The replicas' bucketed, overlapped gradient all-reduce (distflow.train.grad_sync) gives the gradients
FSDP2's native HSDP all-reduce gives, on 2 real gloo ranks with real FSDP2 policies; buckets go
out while backward still runs; a parameter without a gradient is averaged as zeros."""

import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from grad_helpers import assert_grads_close, full_grads, update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.train.grad_sync import ReplicaGradReducer, plan_buckets
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.train.update import Updater


def _policy(model_dir, sync: str, bucket_mib: float = 0.01):
    cfg = fp32_config()
    cfg.model.shard_ranks, cfg.model.replica_grad_sync, cfg.model.grad_bucket_mib = 1, sync, bucket_mib
    cfg.optim.micro_batch_size = 2  # several micro-batches: only the last one all-reduces
    return cfg, Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))


def _worker(rank, world, model_dir):
    samples, adv, _ = fixed_batch()
    per = len(samples) // world
    # Each rank gets different sequences: an un-averaged gradient would differ between ranks.
    batch = update_batch(samples[rank * per:(rank + 1) * per], adv[rank * per:(rank + 1) * per])
    grads = {}
    for sync in ("fsdp", "bucketed"):
        cfg, policy = _policy(model_dir, sync)
        assert (policy.reducer is not None) == (sync == "bucketed")
        Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
        grads[sync] = full_grads(policy.model)
        if sync == "bucketed":
            reducer = policy.reducer
            n_params = sum(len(b) for b in reducer.buckets)
            sent = reducer.ready_at_launch
            assert len(reducer.buckets) > 2 and len(sent) == len(reducer.buckets), (len(reducer.buckets), sent)
            # the first buckets went out while most gradients were still to come: overlap, not a
            # transfer after backward; and all went out as they filled (none left for the end)
            assert sent[0] < n_params / 2 and sent == sorted(sent) and sent[-1] == n_params, (sent, n_params)
            assert reducer._inflight == [] and not reducer._armed
        norm, taken = policy.step(1.0)  # clipping and the step see the averaged gradients
        assert taken and norm > 0
    assert_grads_close(grads["fsdp"], grads["bucketed"], 1e-6, "bucketed vs fsdp")
    # the same gradient on every rank
    g = torch.cat([v.reshape(-1) for v in grads["bucketed"].values()])
    other = g.clone()
    dist.broadcast(other, src=0)
    assert torch.equal(g, other)
    _unused_parameter(rank)
    return grads


def _unused_parameter(rank):
    """Plain parameters (no FSDP): post-accumulate hooks fire from autograd itself. `unused` gets
    no gradient on any rank and is reduced as zeros; the others are the mean over ranks. Per
    tensor (gloo's default) and coalesced (NCCL's: one flat buffer per bucket and dtype, here with
    a bf16 layer beside the float32 ones) give the same averages."""
    for coalesce in (False, True):
        torch.manual_seed(0)
        used, unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        half = torch.nn.Linear(4, 2).to(torch.bfloat16)
        params = [*used.parameters(), *half.parameters(), *unused.parameters()]
        reducer = ReplicaGradReducer(params, dist.group.WORLD, bucket_bytes=64, coalesce=coalesce)
        assert reducer.enabled and reducer.coalesce == coalesce  # every backward averages unless told otherwise
        assert any(len({p.dtype for p in b}) == 2 for b in reducer.buckets)  # a bucket mixes dtypes
        x = torch.full((2, 4), float(rank + 1))
        (used(x).sum() + half(x.to(torch.bfloat16)).float().sum()).backward()
        mean = 2.0 * (1 + 2) / 2  # d/dW of sum(Wx) = sum over rows of x, mean over ranks
        assert torch.equal(used.weight.grad, torch.full((3, 4), mean)), used.weight.grad
        assert torch.equal(half.weight.grad, torch.full((2, 4), mean, dtype=torch.bfloat16)), half.weight.grad
        assert torch.equal(half.bias.grad, torch.full((2,), 2.0, dtype=torch.bfloat16))
        assert torch.equal(unused.weight.grad, torch.zeros(3, 4))
        reducer.remove()


def test_bucketed_equals_native_hsdp_allreduce(tiny_model_dir):
    grads = run_distributed(_worker, 2, tiny_model_dir)
    assert any(float(v.abs().max()) > 0 for v in grads["bucketed"].values())


def test_plan_buckets_keeps_order_and_never_splits():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 1, 4, 1, 5)]
    buckets = plan_buckets(params, bucket_bytes=4 * 4)  # 4 floats
    assert [[p.numel() for p in b] for b in buckets] == [[3, 1], [4], [1, 5]]
    assert [p for b in buckets for p in b] == params
    assert len(plan_buckets(params, 1 << 30)) == 1
