"""Where a step's groups come from: the synchronous source, or the carry-over driver.

`Rollout.collect` runs rounds (one, or DAPO's dynamic-sampling rounds) and asks its source for each
round's finished groups; after the last round it calls `end_step`. The two sources differ only in
how they drive the engine:

- `SyncSource` (pipeline.mode=sync): one blocking generate per round; every group finishes.
- `CarryoverDriver` (pipeline.mode=carryover): a round submits the carried groups (the step's first
  round) and `data.prompts_per_rank` new positions (at the run's first step eta steps' worth more,
  so that eta + 1 steps of groups are in flight), then steps the engine until the quota
  (`data.prompts_per_rank` groups) has finished and no group due at this step still runs
  (distflow.rollout.schedule). It hands out every due group and the earliest other finished ones up
  to the quota; a finished group beyond it waits, generated, for a later step (at the latest its
  due one), so steps stay the size of the quota and the window does not drain. `end_step` aborts
  what still runs and carries it; after the resync the carried samples continue, re-prefilled
  under the new weights, each with a seed keyed by its position, its index and its cut count. The
  engine is empty at every step boundary, so sleep, resync and prefix-cache reset are unchanged.
  With eta = 0 every group is due where it was admitted and the driver makes exactly the
  synchronous engine calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from distflow.config import DistflowConfig
from distflow.rollout import schedule
from distflow.rollout.base import Request, step_unless
from distflow.rollout.carry import CarriedGroup, CarryBuffer
from distflow.sample import Sample
from distflow.seeds import sample_seed


@dataclass
class Finished:
    """A round's finished groups: their stream positions and samples (group-major)."""

    positions: list[int] = field(default_factory=list)
    groups: list[list[Sample]] = field(default_factory=list)


class SyncSource:
    """Every group of a round generated to its end in one blocking call (episodes turn by turn)."""

    def __init__(self, runner, seed: int, group_size: int):
        self.runner, self.seed, self.group_size = runner, seed, group_size

    def admits(self, step: int, per_rank: int, first_round: bool) -> int:
        return per_rank

    def round(self, step: int, positions: list[int], items: list, quota: int) -> Finished:
        groups = self.runner.run(items, self.group_size, [sample_seed(self.seed, p) for p in positions])
        return Finished(list(positions), groups)

    def end_step(self, step: int) -> dict[str, float]:
        return {}


class CarrySteps:
    """The carry-over schedule's bookkeeping both carry-over drivers keep (this module's, and
    distflow.rollout.episode_driver's): the groups in flight and those finished, per step the
    counts, when a round may stop, what it hands out, and what the step boundary carries.
    A group here has `position` and `admitted`; `trained(group)` is its samples as trained."""

    def __init__(self, cfg: DistflowConfig, buffer: CarryBuffer, first_step: int = 1):
        self.buffer, self.first_step = buffer, first_step
        self.seed, self.group_size, self.eta = cfg.run.seed, cfg.algorithm.group_size, cfg.pipeline.max_staleness
        self.groups: dict = {}  # position -> group in flight, in admission order
        self.finished: list = []  # finished, not yet handed out (in the order they finished)
        self.step: int | None = None  # the step whose rounds run
        self.metrics: dict[str, float] = {}
        self._forced_counted = False

    def admits(self, step: int, per_rank: int, first_round: bool) -> int:
        return schedule.admissions(step, self.first_step, per_rank, self.eta, first_round)

    def _start_round(self, step: int) -> bool:
        """A round begins; True when it is the step's first (its counts start afresh: the caller
        admits the carried groups then)."""
        self._forced_counted = False
        if self.step == step:
            return False
        self.step, self.metrics = step, {"forced_groups": 0.0, "reprefill_tokens": 0.0, "reprefill_s": 0.0}
        return True

    def _may_stop(self, step: int, quota: int) -> bool:
        """The round may stop: `quota` groups finished and none due at `step` in flight (the due
        ones still in flight once the quota is in count as forced, once a round)."""
        due = sum(1 for g in self.groups.values() if schedule.due_step(g.admitted, self.eta) <= step)
        if not self._forced_counted and len(self.finished) >= quota and due:
            self.metrics["forced_groups"] += due  # the quota is in, but these must finish now
            self._forced_counted = True
        return schedule.round_done(len(self.finished), quota, due)

    def _complete(self, group) -> None:
        del self.groups[group.position]
        self.finished.append(group)

    def _hand_out(self, step: int, quota: int, trained: Callable) -> Finished:
        """Every due finished group, then the earliest finished others up to `quota` (schedule.hand_out)."""
        chosen = schedule.hand_out([(g.admitted, g.position) for g in self.finished], step, self.eta, quota)
        out = [self.finished[i] for i in chosen]
        self.finished = [g for i, g in enumerate(self.finished) if i not in set(chosen)]
        return Finished([g.position for g in out], [trained(g) for g in out])

    def _carry(self, carried: list[CarriedGroup]) -> dict[str, float]:
        """The step boundary: `carried` becomes the buffer; the step's carry-over counts."""
        self.groups, self.finished, self.buffer.groups = {}, [], carried
        metrics, self.metrics, self.step = self.metrics, {}, None
        metrics.update(carried_groups=float(len(carried)), carried_tokens=float(sum(g.tokens() for g in carried)))
        return metrics


def continued(before: Sample | None, after: Sample, position: int) -> Sample:
    """A sample as trained: what it had before a cut (None: never cut), then what followed, under its
    own prompt; each token keeps the version that generated it."""
    if before is None:
        after.position = position
        return after
    return Sample(before.prompt_ids, before.response_ids + after.response_ids, before.logprobs + after.logprobs,
                  after.truncated, versions=(before.versions or []) + (after.versions or []), position=position)


@dataclass
class _Group:
    """A group in the engine this step: its samples so far (None: still running) and its requests."""

    position: int
    admitted: int
    cuts: int
    samples: list[Sample | None]
    requests: dict[str, list[int]]  # request id -> the sample indices it generates
    partial: list[Sample] | None = None  # a carried group's samples as they were cut


class CarryoverDriver(CarrySteps):
    """The step-wise engine driven for pipeline.mode=carryover (see the module docstring)."""

    def __init__(self, engine, cfg: DistflowConfig, buffer: CarryBuffer, lengths: Callable[[int], int] | None = None,
                 first_step: int = 1):
        """`lengths`: a fixed response length per position, end-of-sequence ignored (a synthetic
        workload's tail, bench/carryover.py); None: rollout.max_new_tokens, ended by the model.
        `first_step`: where the window of eta steps ahead is admitted (a run's step 1)."""
        super().__init__(cfg, buffer, first_step)
        self.engine, self.lengths = engine, lengths
        # a list: (running samples, seconds, whether it prefilled new requests) per engine step
        self.trace: list[tuple[int, float, bool]] | None = None
        self.concurrency, self.budget = cfg.pipeline.max_concurrency, cfg.rollout.max_new_tokens
        self.waiting: list[Request] = []  # over max_concurrency: submitted as room frees
        self.request_group: dict[str, int] = {}  # request id -> position
        self.running_samples = 0

    # ------------------------------------------------------------------ admission
    def _admit_carried(self) -> None:
        carried, self.buffer.groups = self.buffer.groups, []
        for i in schedule.admit_order([(g.admitted, g.position) for g in carried]):
            g = carried[i]
            if not any(s.response_ids for s in g.samples):  # cut before its first token: afresh, as if never cut
                self._admit_fresh(g.position, g.admitted, g.samples[0].prompt_ids)
                continue
            group = _Group(g.position, g.admitted, g.cuts, [None] * len(g.samples), {}, g.samples)
            self.groups[g.position] = group
            budget = self._budget(g.position)
            for k, s in enumerate(g.samples):
                if schedule.sample_done(s, budget):
                    group.samples[k] = s
                    continue
                rid = f"{g.position}.{k}.{g.cuts}"
                group.requests[rid] = [k]
                self._queue(Request(rid, s.prompt_ids + s.response_ids, 1, sample_seed(self.seed, g.position, k, g.cuts),
                                    max_tokens=budget - len(s.response_ids), ignore_eos=self.lengths is not None),
                            g.position)
                self.metrics["reprefill_tokens"] += len(s.prompt_ids) + len(s.response_ids)
            if not group.requests:  # finished before the cut (held back beyond a quota, or ended as it was cut)
                self._complete(group)

    def _admit_new(self, step: int, positions: list[int], items: list) -> None:
        for position, item in zip(positions, items):
            self._admit_fresh(position, step, list(item.prompt_ids))

    def _admit_fresh(self, position: int, admitted: int, prompt_ids: list[int]) -> None:
        """A group's G samples as one request, seeded by its position alone (as the sync path seeds it)."""
        rid, fixed = str(position), self.lengths is not None
        self.groups[position] = _Group(position, admitted, 0, [None] * self.group_size, {rid: list(range(self.group_size))})
        self._queue(Request(rid, prompt_ids, self.group_size, sample_seed(self.seed, position),
                            max_tokens=self._budget(position) if fixed else None, ignore_eos=fixed), position)

    def _budget(self, position: int) -> int:
        return self.budget if self.lengths is None else self.lengths(position)

    def _queue(self, request: Request, position: int) -> None:
        self.request_group[request.request_id] = position
        self.waiting.append(request)

    def _submit_waiting(self) -> bool:
        """Submit what fits under max_concurrency; whether anything was."""
        submitted = False
        while self.waiting and schedule.fits(self.running_samples, self.waiting[0].n, self.concurrency):
            request = self.waiting.pop(0)
            self.engine.submit(request)
            self.running_samples += request.n
            submitted = True
        return submitted

    # ------------------------------------------------------------------ a round
    def round(self, step: int, positions: list[int], items: list, quota: int) -> Finished:
        """Admit (carried groups first, in the step's first round) and step the engine until
        `quota` groups have finished and none due at this step runs; hands out every due group
        and the earliest finished others up to the quota, in position order."""
        first = self._start_round(step)
        if first:
            self._admit_carried()
        self._admit_new(step, positions, items)
        reprefilling = first and self.metrics["reprefill_tokens"] > 0
        while True:
            stop = self._may_stop(step, quota)
            if not stop and not self.groups:
                raise RuntimeError(f"step {step}: the round waits for groups that are not in the engine")
            prefills = self._submit_waiting()
            t0 = time.perf_counter()
            out = step_unless(self.engine, stop)
            if out is None:
                return self._hand_out(step, quota, lambda g: g.samples)
            if reprefilling:  # the engine step that prefilled the carried samples again
                self.metrics["reprefill_s"] += time.perf_counter() - t0
                reprefilling = False
            if self.trace is not None:
                self.trace.append((self.running_samples, time.perf_counter() - t0, prefills))
            for request_id, samples in out:
                self._collect(request_id, samples)

    def _collect(self, request_id: str, samples: list[Sample]) -> None:
        group = self.groups[self.request_group.pop(request_id)]
        self.running_samples -= len(samples)
        for k, s in zip(group.requests.pop(request_id), samples):
            group.samples[k] = self._joined(group, k, s)
        if all(s is not None for s in group.samples):
            self._complete(group)

    def _joined(self, group: _Group, k: int, s: Sample) -> Sample:
        return continued(group.partial[k] if group.partial is not None else None, s, group.position)

    # ------------------------------------------------------------------ the step boundary
    def end_step(self, step: int) -> dict[str, float]:
        """Abort what still runs and carry it (the engine is left empty); the step's carry-over counts."""
        waiting, self.waiting = {r.request_id: r for r in self.waiting}, []
        partials = self.engine.abort([rid for rid in self.request_group if rid not in waiting])
        partials.update({rid: [Sample(list(r.prompt_ids), [], [], True, versions=[]) for _ in range(r.n)]
                         for rid, r in waiting.items()})
        for rid, samples in partials.items():
            group = self.groups[self.request_group.pop(rid)]
            for k, s in zip(group.requests.pop(rid), samples):
                group.samples[k] = self._joined(group, k, s)
        assert not self.request_group, f"requests left after the cut: {sorted(self.request_group)}"
        self.running_samples = 0
        carried = [CarriedGroup(g.position, g.admitted, g.cuts, list(g.samples)) for g in self.finished]
        return self._carry(carried + [CarriedGroup(g.position, g.admitted, g.cuts + 1, list(g.samples))
                                      for g in self.groups.values()])
