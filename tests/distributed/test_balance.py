"""Cross-rank length balancing: the pure assignment, and the exchange over real gloo ranks."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from grad_helpers import assert_grads_close
from config_helpers import fp32_config
from distflow import distributed as dd
from distflow.rollout.balance import balance_groups, balanced_assignment, exchange


def loads(costs, plan):
    return [sum(costs[s][i] for s, i in dest) for dest in plan]


def brute_force_opt(costs) -> int:
    items = [c for row in costs for c in row]
    world = len(costs)
    best = sum(items)
    for choice in itertools.product(range(world), repeat=len(items)):
        acc = [0] * world
        for c, p in zip(items, choice):
            acc[p] += c
        best = min(best, max(acc))
    return best


def check_partition(costs, plan):
    assert len(plan) == len(costs)
    flat = [x for dest in plan for x in dest]
    assert sorted(flat) == [(r, i) for r, row in enumerate(costs) for i in range(len(row))]
    for dest in plan:
        assert dest == sorted(dest)


def test_skewed_two_ranks_reaches_optimum():
    costs = [[100, 90, 80, 70], [5, 5, 5, 5]]
    plan = balanced_assignment(costs)
    check_partition(costs, plan)
    after, opt = loads(costs, plan), brute_force_opt(costs)
    assert max(after) < max(sum(r) for r in costs)
    assert max(after) <= 4 / 3 * opt + max(max(r) for r in costs)
    assert max(after) == opt == 180


@pytest.mark.parametrize("seed", range(6))
def test_lpt_bound_against_brute_force(seed):
    rng = random.Random(seed)
    world = 2 + seed % 2
    costs = [[rng.randint(1, 60) for _ in range(rng.randint(0, 4))] for _ in range(world)]
    costs[0] += [rng.randint(30, 90)]
    plan = balanced_assignment(costs)
    check_partition(costs, plan)
    after, before = max(loads(costs, plan)), max(sum(r) for r in costs)
    # Never worse than before; LPT (or the identity when it does not help) is within 4/3 of optimal.
    assert after <= before
    assert after <= 4 / 3 * brute_force_opt(costs) + 1e-9


def test_balanced_input_is_identity():
    costs = [[10, 20, 30], [30, 20, 10], [60]]
    plan = balanced_assignment(costs)
    assert plan == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)], [(2, 0)]]


def test_no_gain_means_no_move():
    # One group dominates: LPT cannot lower the max load, so nothing moves even though loads differ.
    costs = [[100], [1, 2, 3], [4]]
    assert balanced_assignment(costs) == [[(0, 0)], [(1, 0), (1, 1), (1, 2)], [(2, 0)]]


def test_empty_ranks():
    assert balanced_assignment([[], [], []]) == [[], [], []]
    costs = [[40, 30, 20, 10], [], []]
    plan = balanced_assignment(costs)
    check_partition(costs, plan)
    assert sorted(loads(costs, plan)) == [30, 30, 40]
    assert plan[0] == [(0, 0)]  # the biggest group stays where it is


def test_three_ranks_and_determinism():
    costs = [[50, 50, 50, 50, 50, 50], [10, 10], [7, 0, 3]]
    plan = balanced_assignment(costs)
    check_partition(costs, plan)
    assert plan == balanced_assignment([list(r) for r in costs])
    assert max(loads(costs, plan)) == brute_force_opt(costs) == 110
    # Balancing is idempotent: the balanced layout does not move again.
    moved = [[costs[s][i] for s, i in dest] for dest in plan]
    again = balanced_assignment(moved)
    assert again == [[(r, i) for i in range(len(row))] for r, row in enumerate(moved)]


def test_zero_cost_groups_stay_home():
    costs = [[0, 0], [0]]
    assert balanced_assignment(costs) == [[(0, 0), (0, 1)], [(1, 0)]]


def test_negative_cost_rejected():
    with pytest.raises(ValueError):
        balanced_assignment([[1, -1], [2]])


def test_single_process_is_passthrough():
    assert not dist.is_initialized()
    groups = [{"a": 1}, {"b": 2}]
    out, stats = balance_groups(groups, [3, 4])
    assert out == groups
    assert stats == {"tokens_before_max": 7.0, "tokens_before_min": 7.0, "tokens_after_max": 7.0,
                     "tokens_after_min": 7.0, "moved_groups": 0.0}
    assert exchange([[1, 2]]) == [[1, 2]]


# ---- real gloo ranks ----


@dataclass
class Group:
    gid: tuple[int, int]
    prompt: list[int]
    samples: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(self.prompt) + len(s) for s in self.samples)


def make_group(rank: int, idx: int, size: int) -> Group:
    base = 1000 * rank + 10 * idx
    return Group((rank, idx), [base] * (2 + idx % 3),
                 [[base + k] * (size + k) for k in range(4)])


# Per world size: the response lengths of each rank's groups (the last rank has none).
LAYOUTS = {2: [[40, 35, 30, 5, 3], []], 3: [[60, 50, 40, 30, 20], [8, 4], []]}


def _balance_worker(rank: int, world: int) -> None:
    mine = [make_group(rank, i, n) for i, n in enumerate(LAYOUTS[world][rank])]
    out, stats = balance_groups(mine, [g.tokens for g in mine])

    everything = [None] * world
    dist.all_gather_object(everything, (out, stats))
    every_out = [o for o, _ in everything]
    all_stats = [s for _, s in everything]
    assert all(s == all_stats[0] for s in all_stats)

    expected = sorted((make_group(r, i, n) for r, sizes in enumerate(LAYOUTS[world]) for i, n in enumerate(sizes)),
                      key=lambda g: g.gid)
    got = sorted((g for o in every_out for g in o), key=lambda g: g.gid)
    assert got == expected  # same multiset, every group intact
    for o in every_out:
        assert [g.gid for g in o] == sorted(g.gid for g in o)

    before = [sum(make_group(r, i, n).tokens for i, n in enumerate(sizes)) for r, sizes in enumerate(LAYOUTS[world])]
    after = [sum(g.tokens for g in o) for o in every_out]
    moved = sum(g.gid[0] != r for r, o in enumerate(every_out) for g in o)
    assert stats == {"tokens_before_max": max(before), "tokens_before_min": min(before),
                     "tokens_after_max": max(after), "tokens_after_min": min(after), "moved_groups": moved}
    assert max(after) < max(before) and min(after) > min(before) and moved > 0
    assert all(o for o in every_out)  # the rank that started empty now has work

    # A second pass finds nothing to improve and leaves everything in place.
    again, stats2 = balance_groups(out, [g.tokens for g in out])
    assert again == out and stats2["moved_groups"] == 0

    # Raw exchange: uneven and empty lists, including to oneself.
    outgoing = [[f"{rank}->{d}:{k}" for k in range((rank + 2 * d) % 3)] for d in range(world)]
    incoming = exchange(outgoing)
    assert incoming == [[f"{s}->{rank}:{k}" for k in range((s + 2 * rank) % 3)] for s in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_balance_groups_gloo(world):
    run_distributed(_balance_worker, world, timeout=120)


# ---- balancing changes where samples train, not what is learned ----


def _gradient_worker(rank: int, world: int, model_dir: str) -> dict:
    from grad_helpers import full_grads, update_batch
    from distflow.distributed.layout import ParallelLayout
    from distflow.train.policy import Policy
    from distflow.sample import Sample
    from distflow.train.update import Updater

    torch.manual_seed(0)
    cfg = fp32_config()
    cfg.optim.micro_batch_size = 3
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    g = torch.Generator().manual_seed(11 + rank)
    # rank 0 holds long sequences, rank 1 short ones: 3 groups of 4 each
    groups = []
    for k in range(3):
        p_len, r_len = (30, 12) if rank == 0 else (4, 2)
        samples = [Sample(torch.randint(3, 200, (p_len,), generator=g).tolist(),
                          torch.randint(3, 200, (r_len - (j % 2),), generator=g).tolist(), [], False)
                   for j in range(4)]
        groups.append((samples, torch.randn(4, generator=g)))
    results = {}
    for balance in (False, True):
        mine = groups
        if balance:
            mine, stats = balance_groups(groups, [sum(len(s.prompt_ids) + len(s.response_ids) for s in ss)
                                                  for ss, _ in groups])
            assert stats["moved_groups"] > 0 and stats["tokens_after_max"] < stats["tokens_before_max"]
        samples = [s for ss, _ in mine for s in ss]
        adv = torch.cat([a for _, a in mine])
        batch = update_batch(samples, adv)
        sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
        grads = full_grads(policy.model)
        policy.optimizer.zero_grad(set_to_none=True)
        results[balance] = (float(dd.all_reduce(sums.loss)), grads)
    return results


def test_balancing_leaves_loss_and_gradients_unchanged(tiny_model_dir):
    res = run_distributed(_gradient_worker, 2, tiny_model_dir)
    (l_off, g_off), (l_on, g_on) = res[False], res[True]
    assert l_off != 0.0 and abs(l_off - l_on) <= 1e-5 * abs(l_off)
    assert_grads_close(g_off, g_on, 1e-5)
