"""One rank fails where its peers do not: every rank stops with that rank's line, through the
agreement (distflow.distributed.agreement), instead of the others waiting in their next collective
until its timeout: the helper itself, and a real trainer whose rank 1 raises in its report or in its
checkpoint save (run.fault_inject). Real gloo ranks with a collective timeout of 60 s: a rank left
waiting would end in gloo's timeout error, not in the line. With one rank, the agreement raises
locally."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest

from dist_helpers import gathered, run_distributed

TIMEOUT_S = 60


def _outcome(fn) -> tuple[str, str, float]:
    """(the exception's type, its line, seconds) fn ended with; ("passed", "", seconds) if none."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e), time.monotonic() - t0
    return "passed", "", time.monotonic() - t0


def _guarded(when: str, raise_on: dict[int, BaseException], rank: int):
    from distflow.distributed import one_rank_may_fail

    def region() -> None:
        with one_rank_may_fail(when):
            if rank in raise_on:
                raise raise_on[rank]
    return region


def _worker(rank, world, log_dir):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from distflow.config import ConfigError
    from distflow.distributed import agree, all_reduce
    from distflow.run.output import reset_output, setup_output

    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    log_file = Path(log_dir) / f"rank_{rank}.log"
    setup_output(log_file, rank)
    out = {
        "quiet": _outcome(_guarded("in a quiet region", {}, rank)),
        "one": _outcome(_guarded("scoring step 3", {1: ValueError("boom,\n  on two lines")}, rank)),
        "both": _outcome(_guarded("scoring step 4", {0: KeyError("a"), 1: ZeroDivisionError("b")}, rank)),
        "config": _outcome(_guarded("scoring step 5", {0: ConfigError("task.reward 'x' returned a list")}, rank)),
        "line": _outcome(lambda: agree("could not reach the store" if rank == 0 else None, "after step 6",
                                       RuntimeError, advice="Check the network")),
        "none": _outcome(lambda: agree(None, "after step 7")),
    }
    out["in_step"] = int(all_reduce([1.0])[0])  # the ranks are still in step with each other
    dist.barrier()
    reset_output()
    out["log"] = log_file.read_text()
    return gathered(out)


def test_a_rank_that_raises_in_a_guarded_region_stops_every_rank_with_its_line(tmp_path):
    ranks = run_distributed(_worker, 2, str(tmp_path), timeout=4 * TIMEOUT_S)
    for out in ranks:
        assert out["quiet"][:2] == ("passed", "") and out["none"][:2] == ("passed", "")
        assert out["one"][:2] == ("RunAborted", "rank 1 raised ValueError: boom, on two lines; stopped scoring step 3")
        # two ranks failed: the highest one's line, the same on both
        assert out["both"][:2] == ("RunAborted", "rank 1 raised ZeroDivisionError: b; stopped scoring step 4")
        # distflow's own errors keep their type (and so their exit status)
        assert out["config"][:2] == ("ConfigError", "rank 0 raised ConfigError: task.reward 'x' returned a list; "
                                                    "stopped scoring step 5")
        assert out["line"][:2] == ("RuntimeError", "rank 0 could not reach the store; stopped after step 6. "
                                                   "Check the network")
        assert all(out[k][2] < TIMEOUT_S for k in ("one", "both", "config", "line"))  # did not time out
        assert out["in_step"] == 2
    # the failing rank's log has the traceback; the other rank's has none of it
    assert "Traceback" in ranks[1]["log"] and "ValueError: boom," in ranks[1]["log"]
    assert "ValueError" not in ranks[0]["log"]
    assert "Traceback" in ranks[0]["log"] and "KeyError: 'a'" in ranks[0]["log"]


def test_with_one_rank_the_guard_raises_locally_and_lets_interrupts_through():
    from distflow.distributed import agree, one_rank_may_fail
    from distflow.errors import RunAborted

    with pytest.raises(RunAborted, match=r"^rank 0 raised OSError: gone; stopped reading$"):
        with one_rank_may_fail("reading"):
            raise OSError("gone")
    with pytest.raises(KeyboardInterrupt):
        with one_rank_may_fail("reading"):
            raise KeyboardInterrupt
    with one_rank_may_fail("reading"):
        pass
    agree(None, "now")
    with pytest.raises(RunAborted, match=r"^rank 0 broke; stopped now$"):
        agree("broke", "now")


TRAINER = ["experiment=smoke", "model.dtype=float32", "rollout=hf", "logging.plot_at_end=false",
           "task.reward=rewards_for_tests:digit_fraction", "run.steps=2"]
FAULTS = {"report": ["run.fault_inject=1:1:raise_report"],
          "saving": ["checkpoint.every=1", "run.fault_inject=1:2:raise_saving"]}


def _train(rank, world, tmp):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from config_helpers import compose
    from distflow.trainer import Trainer

    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    out = {}
    for name, faults in FAULTS.items():
        folder = Path(tmp) / name
        trainer = Trainer(compose([*TRAINER, *faults, f"run.output_dir={folder}"]))
        try:
            outcome = _outcome(trainer.train)
        finally:
            trainer.close()
        metrics, checkpoints = folder / "metrics.jsonl", folder / "checkpoints"
        out[name] = {"outcome": outcome, "log": (folder / "logs" / f"rank_{rank}.log").read_text(),
                     "rows": [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
                     if metrics.is_file() else [],
                     "checkpoints": sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []}
    return gathered(out)


def test_a_rank_that_raises_in_its_report_or_its_save_stops_the_run_on_every_rank(tmp_path):
    """A real trainer on 2 ranks: rank 1 raises in step 1's report (run.fault_inject raise_report),
    then, in a second run, in step 2's checkpoint save once its shards are written (raise_saving)."""
    ranks = run_distributed(_train, 2, str(tmp_path), timeout=600)
    saving = tmp_path / "saving" / "checkpoints"
    for out in ranks:
        # a rank left waiting would end in gloo's timeout error (60 s) instead of this line
        kind, line, _ = out["report"]["outcome"]
        assert (kind, line) == ("RunAborted", "rank 1 raised RuntimeError: injected fault on rank 1 in the report of "
                                              "step 1; stopped writing the report of step 1")
        kind, line, _ = out["saving"]["outcome"]
        assert (kind, line) == ("CheckpointSaveError", "checkpoint of step 2: rank 1 raised RuntimeError: injected "
                                f"fault on rank 1 while saving step 2; the save was removed and the latest checkpoint "
                                f"is still {saving}/step_000001 (rank 1's log has the traceback)")
    assert ranks[0]["report"]["rows"] == [1]  # rank 0 wrote step 1's row; nothing after it
    assert ranks[0]["saving"]["rows"] == [1, 2] and ranks[0]["saving"]["checkpoints"] == ["step_000001"]
    assert "RuntimeError: injected fault on rank 1 in the report of step 1" in ranks[1]["report"]["log"]
    assert "Traceback" in ranks[1]["saving"]["log"]


@pytest.mark.parametrize("spec, ok", [("1:2", True), ("1:2+:sleep=1.5", True), ("0:3:raise_saving", True),
                                      ("1:1:raise_report", True), ("1:2:raize", False), ("1:x:raise", False)])
def test_fault_inject_takes_only_the_modes_the_injector_knows(spec, ok):
    """An unknown mode would reach on_batch's last resort, a SIGKILL: it is a config error instead."""
    from distflow.config.run import RunConfig

    failed = [msg for good, msg in RunConfig(fault_inject=spec).checks() if not good]
    assert failed == ([] if ok else [f"run.fault_inject must be RANK:STEP[+][:MODE], MODE one of kill, raise, nan, "
                                     f"kill_saving, raise_saving, raise_report, stale_resync or sleep=S; got '{spec}'"])
