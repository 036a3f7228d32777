"""Step metrics across real gloo ranks: rank 0 alone writes metrics.jsonl with the reduced values,
and the wait clock with the slowest rank found in the maxima's all-reduce."""

import json
import os
import time

from dist_helpers import gathered, run_distributed
from distflow import distributed as dd
from distflow.config import LoggingConfig
from distflow.metrics.loggers import MetricLogger, reduce_step_metrics
from distflow.metrics.report import slowest_rank_code, with_compute
from distflow.run.rundir import RunDir


def _log_on_two_ranks(rank, world, out):
    logger = MetricLogger(RunDir(out), rank == 0, 2, LoggingConfig(loggers=["console", "jsonl"], progress_bar=False),
                          {})
    for step in (1, 2):
        m = reduce_step_metrics({"reward_sum": float(rank + step)}, {"len_max": float(10 * rank + step)})
        logger.log({"step": step, **m})
    logger.close()


def test_jsonl_is_written_by_rank0_only_with_reduced_values(tmp_path):
    out = tmp_path / "run"
    run_distributed(_log_on_two_ranks, 2, str(out), timeout=180)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # one row per step (not one per rank), carrying the cross-rank sum and max
    assert rows == [{"step": 1, "reward_sum": 3.0, "len_max": 11.0}, {"step": 2, "reward_sum": 5.0, "len_max": 12.0}]
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


def _late_rank(rank, world):
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
    return gathered((waited, g))


def test_wait_clock_and_slowest_rank_on_three_ranks():
    got = run_distributed(_late_rank, 3)
    # ranks 0 and 2 waited for rank 1 twice (0.4 s each, the first less any start-up skew); rank 1
    # hardly at all; the 0.1 s block counted once
    assert got[0][0] >= 0.7 + 0.1 and got[2][0] >= 0.7 + 0.1, got
    assert got[1][0] < 0.1 + 0.3, got
    for _, g in got:  # every rank agrees
        assert g["timing/wait_s"] == max(w for w, _ in got)
        assert g["timing/wait_min_s"] == got[1][0]
        assert int(g["timing/slowest_rank"]) % 3 == 1
