"""Waiting made visible: the wait clock of distflow's collectives, the slowest rank found in the
maxima's all-reduce, and the warning that names a rank slow for many steps."""

import time

import distflow.distributed as dd
from distflow.metrics.report import StragglerWatch, slowest_rank_code, with_compute


class QueuedWork:
    """A work handle as NCCL gives one: wait() returns once the collective is queued on the
    device; it completes `delay_s` later."""

    def __init__(self, delay_s: float):
        self.done_at = time.perf_counter() + delay_s
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at


def test_wait_clock_counts_until_an_asynchronous_collective_completes():
    before = dd.waited_s()
    with dd.waiting():  # the handles are made inside the clock, so it spans their whole delay
        works = [QueuedWork(0.05), QueuedWork(0.2)]
        dd.complete(works)
    assert all(w.waited and w.is_completed() for w in works)
    assert dd.waited_s() - before >= 0.2  # wait() alone would have returned at once


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


def test_phase_edges_wait_for_the_device_only_when_asked_on_cuda():
    import torch

    from distflow.metrics.timer import PhaseTimer

    assert PhaseTimer(torch.device("cpu"), True).edge is None  # the CPU has no queue to wait for
    assert PhaseTimer(torch.device("cuda", 0), False).edge is None
    assert PhaseTimer(torch.device("cuda", 0), True).edge is torch.cuda.synchronize
    edges, seen = [], []

    class Watch:
        def on_phase_start(self, phase, step):
            seen.append(("start", phase, step))

        def on_phase_end(self, phase, step, seconds):
            seen.append(("end", phase, step, seconds))

    timer = PhaseTimer(torch.device("cpu"), observers=[Watch()])
    timer.edge = lambda: edges.append(time.perf_counter())
    timing = timer.new_step(3)
    with timer.phase("update"):
        time.sleep(0.01)
    with timer.phase("update"):  # a repeated phase accumulates
        pass
    assert len(edges) == 4 and timing["update"] >= edges[1] - edges[0] - 1e-3  # both edges inside the clock
    assert [s[:3] for s in seen] == [("start", "update", 3), ("end", "update", 3)] * 2
    assert timing["update"] == seen[1][3] + seen[3][3]
