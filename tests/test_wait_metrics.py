"""Waiting made visible: the wait clock of distflow's collectives, the slowest rank found in the
maxima's all-reduce, and the warning that names a rank slow for many steps."""

import time

from dist_helpers import run_distributed
from distflow import distributed as dd
from distflow.metrics import reduce_step_metrics
from distflow.reporting import StragglerWatch, slowest_rank_code, with_compute


def _late_rank(rank, world, out):
    """Rank 1 reaches each collective 0.4 s after rank 0: rank 0's clock shows the wait."""
    before = dd.waited_s()
    for _ in range(2):
        if rank == 1:
            time.sleep(0.4)
        dd.all_reduce(1.0)
    with dd.waiting(), dd.waiting():  # nested blocks count once
        time.sleep(0.1)
    waited = dd.waited_s() - before
    compute = {0: 1.0, 1: 3.0005, 2: 2.0}[rank]  # rank 1 is the slowest (its time rounds to whole ms in the code)
    timing = with_compute({"step": compute + waited, "wait": waited})
    g = reduce_step_metrics({}, {"timing/wait_s": waited, "timing/slowest_rank": slowest_rank_code(timing["compute"])},
                            {"timing/wait_min_s": waited})
    out.put((rank, waited, g))


def test_wait_clock_and_slowest_rank_on_three_ranks(tmp_path):
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    run_distributed(_late_rank, 3, q)
    got = {}
    while not q.empty():
        rank, waited, g = q.get()
        got[rank] = (waited, g)
    assert sorted(got) == [0, 1, 2]
    # ranks 0 and 2 waited for rank 1 twice (0.4 s each, the first less any start-up skew); rank 1
    # hardly at all; the 0.1 s block counted once
    assert got[0][0] >= 0.7 + 0.1 and got[2][0] >= 0.7 + 0.1, got
    assert got[1][0] < 0.1 + 0.3, got
    for _, g in got.values():  # every rank agrees
        assert g["timing/wait_s"] == max(w for w, _ in got.values())
        assert g["timing/wait_min_s"] == got[1][0]
        assert int(g["timing/slowest_rank"]) % 3 == 1


def test_with_compute_subtracts_the_wait():
    assert with_compute({"step": 5.0, "wait": 1.5})["compute"] == 3.5
    assert with_compute({"step": 2.0}) == {"step": 2.0, "wait": 0.0, "compute": 2.0}


def test_slowest_rank_code_orders_by_time_then_rank():
    # one rank's view; the codes of two ranks compare by time first (world size 1 here: rank 0)
    assert slowest_rank_code(1.2344) == 1234.0 and slowest_rank_code(0.0) == 0.0


def test_straggler_watch_names_a_persistent_slow_rank_once_per_streak():
    watch = StragglerWatch(3)
    row = lambda rank, slow, fast: {"timing/slowest_rank": rank, "timing/compute_s": slow,  # noqa: E731
                                    "timing/compute_min_s": fast}
    assert [watch.observe(row(1, 2.0, 1.0)) for _ in range(2)] == [None, None]
    note = watch.observe(row(1, 2.0, 1.0))
    assert note.startswith("rank 1 was the slowest for 3 consecutive steps") and "2.00 s" in note
    assert watch.observe(row(1, 2.0, 1.0)) is None  # once per streak
    # another rank, or a difference within the noise margin, starts over
    assert watch.observe(row(0, 2.0, 1.0)) is None and watch.streak == 1
    assert watch.observe(row(0, 1.05, 1.0)) is None and watch.streak == 0
    assert [watch.observe(row(0, 2.0, 1.0)) for _ in range(3)][-1] is not None
    off = StragglerWatch(0)
    assert all(off.observe(row(1, 9.0, 1.0)) is None for _ in range(10))
