"""A full disk under the run folder stops every rank together, with one line naming the file and
the free space: at start-up (config.json), at a step's end when rank 0 could not write
metrics.jsonl, and when another rank could not write its log. Real gloo ranks, a real full tmpfs
(tests/support/mount_helpers.py), a collective timeout of seconds so a rank left waiting fails fast."""

from __future__ import annotations

import datetime
import io
import logging
import sys
import time
from pathlib import Path

from config_helpers import fp32_config
from dist_helpers import gathered, run_distributed
from mount_helpers import fill, private_tmpfs

FREE = "Free space and relaunch with the same run.output_dir to continue from its last checkpoint"


def _row(step: int) -> dict:
    return {"step": step, **{f"metric/{i}": 0.123456789 for i in range(400)}}  # ~9 KB: more than a page


def _stopped(fn) -> tuple[str, float]:
    """(the one line fn stopped with, seconds it took)."""
    from distflow.config import ConfigError
    from distflow.errors import RunAborted

    t0 = time.monotonic()
    try:
        fn()
    except (ConfigError, RunAborted) as e:
        return str(e), time.monotonic() - t0
    return "did not stop", time.monotonic() - t0


def _worker(rank, world, mount):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from distflow.config import LoggingConfig
    from distflow.metrics.loggers import MetricLogger
    from distflow.run.output import reset_output, save_config, setup_output
    from distflow.run.preemption import StepBoundary, StopSignal
    from distflow.run.rundir import RunDir

    _set_pg_timeout(datetime.timedelta(seconds=20))  # a rank left waiting fails here in seconds, not 600
    mount, log = Path(mount), logging.getLogger("distflow")
    run = RunDir(mount / "run")
    console, sys.stderr = sys.stderr, io.StringIO()  # what logging would print about its failed writes
    setup_output(run.rank_log(rank), rank)
    out, boundary, no_signal = {}, StepBoundary(0, 0.0, False), StopSignal()

    log.info("start")  # each rank's log has its first page before the disk fills
    dist.barrier()
    filler = fill(mount) if rank == 0 else None  # start-up: rank 0 writes config.json onto a full disk
    out["config"] = _stopped(lambda: save_config(fp32_config(), run.config, write=rank == 0))
    if rank == 0:
        filler.unlink()
    dist.barrier()  # the space is free again

    logger = MetricLogger(run, rank == 0, 3, LoggingConfig(loggers=["jsonl"]), {})
    log.info("step 1")
    logger.log(_row(1))
    out["step1"] = boundary.decide(1, False, no_signal)
    if rank == 0:  # step 2: rank 0's metrics row finds the disk full
        filler = fill(mount)
    logger.log(_row(2))
    out["metrics"] = _stopped(lambda: boundary.decide(2, False, no_signal))
    logger.close()
    if rank == 0:  # space freed, the run resumed from step 1: its rows are all there, the torn one dropped
        filler.unlink()
        MetricLogger(run, True, 3, LoggingConfig(loggers=["jsonl"]), {}, resumed_step=1).close()
        out["rows"] = [line[:11] for line in run.metrics.read_text().splitlines()]
    dist.barrier()  # the space is free again

    if rank == 1:  # step 3: rank 1's log finds the disk full
        filler = fill(mount)
        log.info("step 3 " + "x" * 8192)
    log.info("a line after the failure")
    out["log"] = _stopped(lambda: boundary.decide(3, False, no_signal))
    if rank == 1:
        filler.unlink()
    out["log_file"] = run.rank_log(rank).read_text()
    reset_output()
    out["stderr"], sys.stderr = sys.stderr.getvalue(), console
    return gathered(out)


def test_a_full_disk_stops_every_rank_together_with_one_line(tmp_path):
    with private_tmpfs(tmp_path / "mnt", size="256k") as mount:
        ranks = run_distributed(_worker, 2, str(mount), timeout=120)
    run = mount / "run"
    full = "No space left on device (0 B free there)"
    for r, out in enumerate(ranks):
        assert out["config"][0] == f"could not write {run}/config.json: {full}", out["config"]
        assert out["step1"] == (False, False)
        assert out["metrics"][0] == f"rank 0 could not write {run}/metrics.jsonl: {full}; stopped after step 2. {FREE}"
        assert out["log"][0] == f"rank 1 could not write {run}/logs/rank_1.log: {full}; stopped after step 3. {FREE}"
        assert max(out["config"][1], out["metrics"][1], out["log"][1]) < 5, out  # together, not at a timeout
        assert out["stderr"] == "", out["stderr"]  # no traceback per failed record
        assert "step 1" in out["log_file"]
    assert ranks[0]["rows"] == ['{"step": 1,']  # step 1's row kept, the row cut short by the full disk dropped
    assert "a line after the failure" in ranks[0]["log_file"]
    # rank 1's log keeps what fitted (the record it failed on cut short) and nothing after it
    assert "x" * 8192 not in ranks[1]["log_file"] and "a line after" not in ranks[1]["log_file"]
