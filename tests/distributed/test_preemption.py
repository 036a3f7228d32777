"""The step boundary on real gloo ranks: a save that one rank's clock makes due, or a signal that one
rank alone received, is the same decision on every rank (end to end: e2e/test_preemption_runs.py)."""

import os
import signal

from dist_helpers import gathered, run_distributed
from distflow.run.preemption import StepBoundary, StopSignal


def _decide(rank, world):
    flag = StopSignal()
    boundary = StepBoundary(every_steps=4, every_s=30.0, at_end=False)
    results = {"quiet": boundary.decide(1, False, flag)}
    boundary.last_save -= 31.0 * rank  # rank 1's clock says a save is due: every rank saves
    results["clock"] = boundary.decide(2, False, flag)
    boundary.saved()
    results["interval"] = boundary.decide(4, False, flag)
    if rank == 0:  # a signal seen by rank 0 only
        flag.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
        flag.uninstall()
        assert (flag.name, flag.count) == ("SIGUSR1", 2)
    results["signal"] = boundary.decide(5, False, flag)
    results["signal_last_step"] = boundary.decide(6, True, flag)
    return gathered(results)


def test_every_rank_takes_the_same_save_and_stop_decision():
    a, b = run_distributed(_decide, 2)
    assert a == b == {"quiet": (False, False), "clock": (True, False), "interval": (True, False),
                      "signal": (True, True), "signal_last_step": (False, False)}
