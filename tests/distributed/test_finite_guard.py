"""A non-finite loss or gradient on any rank: every rank skips the optimizer step, the weights stay
bit-for-bit as they were, the step is counted, and too many in a row end the run. An exactly zero
gradient (every advantage zero) is not stepped either, unless optim.skip_zero_gradient=false: then
AdamW's moments alone move the weights."""

import torch

from dist_helpers import gathered, run_distributed
from grad_helpers import update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.train.update import Updater


def _nan_on_one_rank(rank, world, model_dir):
    cfg = fp32_config()
    cfg.optim.micro_batch_size = 2
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    samples, adv, _ = fixed_batch()
    local = samples[rank::world]
    weights = lambda: {n: p.full_tensor().clone() for n, p in policy.model.named_parameters()}  # noqa: E731
    before = weights()
    results = []
    # NaN on one sample of rank 0; then a finite batch; then all advantages zero, skipped and not
    for case in ("poisoned", "finite", "zero", "zero_stepped"):
        a = adv[rank::world].clone()
        if case == "poisoned" and rank == 0:
            a[1] = float("nan")
        if case.startswith("zero"):
            a.zero_()
        policy.skip_zero_gradient = case != "zero_stepped"
        batch = update_batch(local, a)
        sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
        norm, outcome = policy.step(sums.loss)
        after = weights()
        results.append({"loss": sums.loss, "norm": norm, "outcome": outcome,
                        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                        "optimizer_state": len(policy.optimizer.state), "lr_step": policy.scheduler.last_epoch,
                        "grads_cleared": all(p.grad is None for p in policy.model.parameters())})
        before = after
    return gathered(results)


def test_nan_on_one_rank_skips_the_step_on_every_rank(tiny_model_dir):
    r0, r1 = run_distributed(_nan_on_one_rank, 2, tiny_model_dir)
    bad0, bad1 = r0[0], r1[0]
    assert bad0["loss"] != bad0["loss"] and bad1["loss"] == bad1["loss"]  # NaN on rank 0 only
    for bad in (bad0, bad1):  # both ranks skipped, nothing moved, nothing left behind
        assert bad["outcome"] == "nonfinite" and bad["unchanged"] and bad["grads_cleared"]
        assert bad["optimizer_state"] == 0 and bad["lr_step"] == 0
    for rank in (r0, r1):
        good, zero, zero_stepped = rank[1:]
        assert good["outcome"] == "taken" and not good["unchanged"] and good["lr_step"] == 1
        # no gradient anywhere: not stepped, so the schedule and Adam's moments wait too
        assert zero["norm"] == 0.0 and zero["outcome"] == "zero_gradient" and zero["unchanged"]
        assert zero["lr_step"] == 1 and zero["grads_cleared"]
        # stepped anyway, the same zero gradient moves the weights: Adam's first moment from `good`
        assert zero_stepped["norm"] == 0.0 and zero_stepped["outcome"] == "taken"
        assert not zero_stepped["unchanged"] and zero_stepped["lr_step"] == 2
