"""The carry-over schedule's rules, as pure functions of counts and steps (no engine, no process group).

Version v is the policy after v optimizer steps; step s generates with version s - 1. A group
admitted at step a is due at step a + eta (pipeline.max_staleness): a step may stop generating
only once its quota has finished and no due group still runs, so a group trains at step a + eta
at the latest and every token trained at step s comes from a version >= a - 1 >= s - 1 - eta.
With eta = 0 every group is due where it was admitted: the synchronous schedule.
"""

from __future__ import annotations

from distflow.sample import Sample


def due_step(admitted: int, max_staleness: int) -> int:
    """The step at which a group admitted at `admitted` must have finished (it trains there)."""
    return admitted + max_staleness


def admissions(step: int, first_step: int, per_rank: int, max_staleness: int, first_round: bool) -> int:
    """New positions a round admits: the quota, and at the run's first step eta steps' quotas ahead,
    so that (eta + 1) steps of groups are in flight and a step can stop at its quota while the rest
    runs on."""
    return per_rank * (1 + max_staleness) if step == first_step and first_round else per_rank


def hand_out(finished: list[tuple[int, int]], step: int, max_staleness: int, quota: int) -> list[int]:
    """Which finished groups a round hands out: every due one, then the earliest other finished ones
    up to `quota`; the rest wait (finished, nothing to generate), at the latest until their due step.
    `finished` holds (admitted step, position) in the order the groups finished; returns indices
    into it, in position order."""
    due = [i for i, (a, _) in enumerate(finished) if due_step(a, max_staleness) <= step]
    others = [i for i, (a, _) in enumerate(finished) if due_step(a, max_staleness) > step]
    return sorted(due + others[: max(0, quota - len(due))], key=lambda i: finished[i][1])


def round_done(finished: int, quota: int, due_running: int) -> bool:
    """A round of step generation may stop: `quota` groups finished since it began, none due runs."""
    return finished >= quota and due_running == 0


def sample_done(sample: Sample, budget: int) -> bool:
    """Whether a sample handed back by an abort had ended: an end-of-sequence token (not truncated)
    or its whole token budget; anything else is continued after the resync."""
    return not sample.truncated or len(sample.response_ids) >= budget


def oldest_allowed(step: int, max_staleness: int) -> int:
    """The oldest version a token trained at `step` may come from."""
    return step - 1 - max_staleness


def bound_problem(step: int, oldest: int, max_staleness: int) -> str | None:
    """The line a step stops with when its oldest token is older than the bound allows; None: it holds."""
    allowed = oldest_allowed(step, max_staleness)
    if oldest >= allowed:
        return None
    return (f"step {step}: a token of policy version {oldest} would train, older than step - 1 - "
            f"pipeline.max_staleness = {allowed}; stopping")


def staleness(step: int, versions: list[int]) -> list[int]:
    """Per token: how many versions behind the engine's at `step` (s - 1) its generating policy was."""
    return [step - 1 - v for v in versions]


def deal(positions: list[int], rank: int, world_size: int) -> list[int]:
    """The indices of `positions` a rank keeps after a resize: position p goes to rank p mod W (the
    sampler deals stream positions so, when the offset is a multiple of W), so every carried group
    lands on exactly one rank."""
    return [i for i, p in enumerate(positions) if p % world_size == rank]


def admit_order(carried: list[tuple[int, int]]) -> list[int]:
    """The order carried groups re-enter the engine: the earliest due first, then by position.
    `carried` holds (admitted step, position) per group; returns indices into it."""
    return sorted(range(len(carried)), key=lambda i: carried[i])


def fits(running_samples: int, request_samples: int, max_concurrency: int | None) -> bool:
    """Whether a request of `request_samples` samples may enter an engine running `running_samples`
    (an empty engine always takes one, so a group larger than the limit still runs)."""
    return max_concurrency is None or running_samples == 0 or running_samples + request_samples <= max_concurrency
