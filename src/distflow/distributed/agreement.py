"""A rank failed: every rank learns which, and raises the same line.

A rank that raises where its peers do not leaves them waiting in their next collective until the
process group's timeout (run.collective_timeout_s), and the job ends in a timeout instead of its
cause. Where a failure is local to one rank the ranks agree on it instead: one all_reduce(max) of
`rank + 1` (0: this rank is fine) names the highest failing rank, that rank broadcasts its
failure, and every rank raises the same exception with the same line. With one rank it raises
locally, with no collective.

Every rank must reach the agreement, failed or not, so a guarded region (`one_rank_may_fail`)
holds no collective: a rank that failed inside one would skip a collective its peers enter. The
agreement's waits are on the wait clock (distflow.distributed.collectives.waiting) like
distflow's other collectives. Used by each phase of a checkpoint save, the failed-write check at a
step's end (distflow.run.preemption) and the trainer's rank-local regions.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, TypeVar

import torch.distributed as dist

from distflow.distributed.collectives import all_reduce, global_rank, rank_and_world, role_group, waiting
from distflow.errors import ConfigError, RunAborted, RunComplete

log = logging.getLogger("distflow")
T = TypeVar("T")

# distflow's own exceptions keep their type on every rank, so the exit status stays theirs
# (distflow.errors); any other exception becomes the guard's `exc_type`.
KEPT_TYPES = (ConfigError, RunAborted, RunComplete)


def failure_code(failed: bool) -> float:
    """rank + 1 when this rank failed, else 0: an all_reduce(max) of it names the highest failing
    rank. A caller may carry it in an all_reduce of its own (StepBoundary.decide does)."""
    return float(rank_and_world()[0] + 1) if failed else 0.0


def failed_rank(code: float, failure: T | None) -> tuple[int, T] | None:
    """(rank, its failure) for the rank that an all_reduced `code` names, broadcast from that rank so
    every rank holds the same; None when no rank failed. Collective when one did."""
    if not code:
        return None
    src, box = int(code) - 1, [failure]
    if rank_and_world()[1] > 1:
        with waiting():
            dist.broadcast_object_list(box, group=role_group(), group_src=src)
    return global_rank(src), box[0]


def agree_failure(failure: T | None) -> tuple[int, T] | None:
    """Collective: each rank passes its failure (None: it is fine); every rank gets the highest
    failing rank's, or None."""
    return failed_rank(float(all_reduce([failure_code(failure is not None)], "max")[0]), failure)


def raise_agreed(found: tuple[int, str] | None, when: str, exc_type: type[Exception] = RunAborted,
                 advice: str = "") -> None:
    """`exc_type("rank N <line>; stopped <when>[. <advice>]")` for an agreed (rank, line); nothing for None."""
    if found is not None:
        rank, line = found
        raise exc_type(f"rank {rank} {line}; stopped {when}" + (f". {advice}" if advice else ""))


def agree(line: str | None, when: str, exc_type: type[Exception] = RunAborted, advice: str = "") -> None:
    """Collective: when any rank's `line` is not None, every rank raises the same exc_type naming the
    highest failing rank and its line (`raise_agreed`)."""
    raise_agreed(agree_failure(line), when, exc_type, advice)


def one_line(error: BaseException) -> str:
    """An exception's message on one line (some libraries' span several)."""
    return " ".join(str(error).split())


@contextmanager
def one_rank_may_fail(when: str, exc_type: type[Exception] = RunAborted) -> Iterator[None]:
    """Guard a region that holds no collective and may raise on one rank alone: an Exception there is
    logged with its traceback (the rank's log file only, so the console keeps one line), and then,
    on every rank, the agreement: each raises `rank N raised <Type>: <message>; stopped <when>`, as
    the failing rank's type when it is one of KEPT_TYPES, else as `exc_type`. KeyboardInterrupt and
    SystemExit pass through untouched. Every rank passes the agreement even when nothing failed:
    one small all_reduce."""
    failure: tuple[type[Exception], str] | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any error of this rank, told to every rank below
        log.debug(f"{when}: this rank raised; every rank stops with it", exc_info=True)
        failure = (type(e) if isinstance(e, KEPT_TYPES) else exc_type, f"raised {type(e).__name__}: {one_line(e)}")
    found = agree_failure(failure)
    if found is not None:
        rank, (kind, line) = found
        raise_agreed((rank, line), when, kind)
