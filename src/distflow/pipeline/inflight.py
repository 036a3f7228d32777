"""pipeline.apply=inflight: a rollout rank whose engine runs the groups of several steps at once and
applies each version as soon as it arrives.

The staged rank (distflow.pipeline.rollout_rank) generates one target at a time and applies a version
only where a target starts, so its engine drains at the end of every target (the step's longest
sequence) and waits there for the weights. Here the groups of every admissible target run in the engine
together: target s is admitted once the engine holds version >= s - 1 - eta (the bound), and sent once
all its groups have finished, targets in order (a step's groups all train at that step);
pipeline.max_concurrency holds a target back until its samples fit (distflow.pipeline.schedule.admits).
A thread (`StagedVersions`) receives the announces and joins the weight broadcasts as they come, into
tensors of their own, so the trainer never waits for an engine step; between two engine steps the loop
takes the newest version received, aborts what runs (tokens, logprobs and their versions kept), loads it
and re-prefills every unfinished sample under it, each continuation seeded by its position, index and
cut count as carry-over's are (pipeline.kv_after_update=keep instead loads it under the running samples,
which go on with their KV cache, except at every recompute_every-th version). So every token carries the
version that generated it, none trained at step s is older than s - 1 - eta or newer than s - 1 (version
s exists only once step s has trained), and which tokens come from which version depends on timing: two
runs differ, and eta = 0 is not the sync run. DAPO's dynamic sampling filters without rounds (the
rollout ranks never wait for each other): every target draws its share x (1 + pipeline.oversample) on
every rollout rank alike, so their draws stay one stream, and sends the groups whose rewards differ.
Where a target is due (the trainers hold version s - 1) with groups still running, pipeline.late may
move those the bound allows to the next target (`retarget`) or abort them (`drop`) once one of its
groups is done.

Multi-turn episodes (task.env) run the same way, each one a state machine whose turns are requests
(distflow.pipeline.inflight_episodes, with pipeline.env_wait).

Checkpoints and signals are those of the staged mode: each target's message carries the data cursor
as it was right after the target's positions were drawn, so a checkpoint after step c (targets up to
c + eta, sent already) resumes before target c + eta + 1, which a stopping rank drops unsent and the
resumed run draws again; the cursor also names the positions drawn before it that were moved on and
not sent yet (`retry`), which the resumed run draws first.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

from distflow.algorithms import dynamic_sampling_keep
from distflow.pipeline.rollout_rank import RolloutRank
from distflow.pipeline.schedule import admits
from distflow.rollout.base import Request
from distflow.rollout.driver import continued
from distflow.rollout.groups import Rollouts
from distflow.rollout.schedule import sample_done
from distflow.sample import Sample
from distflow.seeds import sample_seed


@dataclass
class _Group:
    target: int  # the step that trains it (pipeline.late=retarget may move it one step on)
    position: int
    start: int  # the engine's version when it was admitted (the oldest of its tokens)
    drawn: int  # the target it was drawn for: until sent, a checkpoint must draw it again
    samples: list[Sample | None]  # None: still running
    before: list[Sample | None]  # each sample as far as it got before its last cut (None: never cut)
    requests: dict[str, list[int]]  # request id -> the sample indices it generates
    cuts: int = 0


class InflightGroups:
    """The groups in the engine, of every admitted target: stepped together, cut where a version is
    applied and continued under it (`recompute`)."""

    pool_lock = contextlib.nullcontext()  # held while this rank scores (multi-turn episodes: the environment's)

    def __init__(self, engine, seed: int, group_size: int, budget: int):
        self.engine, self.seed, self.group_size, self.budget = engine, seed, group_size, budget
        self.groups: dict[int, _Group] = {}  # position -> group
        self.owner: dict[str, int] = {}  # running request id -> its group's position
        self.reprefilled = 0  # tokens prefilled again after versions were applied

    def admit(self, target: int, positions: list[int], prompts: list[list[int]]) -> None:
        """A target's groups, G samples of each prompt as one request seeded by its position (as sync seeds it)."""
        g = self.group_size
        for position, prompt in zip(positions, prompts):
            rid = str(position)
            self.groups[position] = _Group(target, position, self.engine.version, target, [None] * g, [None] * g,
                                           {rid: list(range(g))})
            self._submit(Request(rid, list(prompt), g, sample_seed(self.seed, position)), position)

    def _submit(self, request: Request, position: int) -> None:
        self.owner[request.request_id] = position
        self.engine.submit(request)

    def running(self) -> bool:
        return bool(self.owner)

    def running_samples(self) -> int:
        """Samples not finished yet (each runs in the engine: pipeline.max_concurrency counts them)."""
        return sum(s is None for g in self.groups.values() for s in g.samples)

    def step(self) -> None:
        for rid, samples in self.engine.step():
            self._collect(rid, samples)

    def _collect(self, rid: str, samples: list[Sample]) -> None:
        group = self.groups[self.owner.pop(rid)]
        for k, s in zip(group.requests.pop(rid), samples):
            group.samples[k] = continued(group.before[k], s, group.position)

    def recompute(self, load: Callable[[], None]) -> None:
        """Abort what runs (keeping its tokens), `load` a version, and continue every unfinished sample
        under it: prompt and response so far re-prefilled, the rest of its token budget to go."""
        for rid, samples in self.engine.abort(list(self.owner)).items():
            self._collect(rid, samples)
        load()
        for group in sorted(self.groups.values(), key=lambda x: x.position):
            cut = [k for k, s in enumerate(group.samples) if not sample_done(s, self.budget)]
            if cut:
                group.cuts += 1
            for k in cut:
                s = group.before[k] = group.samples[k]
                group.samples[k], rid = None, f"{group.position}.{k}.{group.cuts}"
                group.requests[rid] = [k]
                self._submit(Request(rid, s.prompt_ids + s.response_ids, 1,
                                     sample_seed(self.seed, group.position, k, group.cuts),
                                     max_tokens=self.budget - len(s.response_ids)), group.position)
                self.reprefilled += len(s.prompt_ids) + len(s.response_ids)

    def late(self, target: int, eta: int, last: int, rule: str) -> int:
        """pipeline.late for `target`, due now (the trainers hold version target - 1) but still running: once
        one of its groups has finished, `retarget` moves the running ones that started with version
        >= target - eta to target + 1 (the bound holds there too; none past the run's `last` step), `drop`
        aborts them. Returns the groups moved or dropped."""
        mine = [grp for grp in self.groups.values() if grp.target == target]
        if not any(None not in grp.samples for grp in mine):
            return 0
        running = [grp for grp in mine if None in grp.samples]
        if rule == "retarget":
            moved = [grp for grp in running if target < last and grp.start >= target - eta]
            for grp in moved:
                grp.target = target + 1
            return len(moved)
        rids = [rid for grp in running for rid in grp.requests]
        self.engine.abort(rids)
        for rid in rids:
            del self.owner[rid]
        for grp in running:
            del self.groups[grp.position]
        return len(running)

    def undelivered(self, target: int) -> list[int]:
        """Positions drawn for `target` or before that are not sent yet (moved to a later target): a
        checkpoint that holds `target` must have them drawn again."""
        return sorted(p for p, grp in self.groups.items() if grp.drawn <= target)

    def done(self, target: int) -> bool:
        return all(s is not None for g in self.groups.values() if g.target == target for s in g.samples)

    def take(self, target: int) -> tuple[list[int], list[Sample]]:
        """A finished target's positions and samples (group-major), in position order."""
        mine = sorted(p for p, g in self.groups.items() if g.target == target)
        return mine, [s for p in mine for s in self.groups.pop(p).samples]

    def drop(self) -> None:
        """Abort everything (the run stops: these targets are drawn again after a resume)."""
        self.engine.abort(list(self.owner))
        self.groups, self.owner = {}, {}

    def close(self) -> None:
        """Nothing to stop (multi-turn episodes: the environment's thread)."""


class InflightRolloutRank(RolloutRank):
    """A rollout rank of a split run with pipeline.apply=inflight (see the module docstring)."""

    def generate(self) -> None:
        """Every target, admitted as the bound allows and sent as it finishes (see the module docstring)."""
        self.live = self.groups()
        try:
            self._generate()
        finally:
            self.live.close()

    def groups(self) -> InflightGroups:
        """The groups in the engine: each sample one request, or an episode (task.env)."""
        cfg, engine = self.cfg, self.rollout.engine
        args = (engine, cfg.run.seed, cfg.algorithm.group_size, cfg.rollout.max_new_tokens)
        if not cfg.task.env:
            return InflightGroups(*args)
        from distflow.pipeline.inflight_episodes import InflightEpisodes  # it builds on InflightGroups

        rollout = self.rollout
        return InflightEpisodes(*args, rollout.runner, lambda p: rollout.items[rollout.sampler.item(p)].fields,
                                cfg.pipeline.env_wait)

    def _generate(self) -> None:
        cfg = self.cfg
        eta, steps, engine = cfg.pipeline.max_staleness, cfg.run.steps, self.rollout.engine
        self.ended = False
        if self.run.resume.checkpoint is not None:
            first, tensors = self.versions.wait()
            self.take([(first, tensors)])
            self.start_from(first)
        admitted, busy, late = self.target, 0.0, 0
        drawn: dict[int, tuple[int, dict]] = {}  # target -> its first position, the cursor after it
        self.timer.new_step(self.target)
        while True:
            if not self.take(self.versions.poll()):
                return
            while admitted <= steps and admits(admitted, engine.version, eta, self.live.running_samples(),
                                               self.draws() * cfg.algorithm.group_size, cfg.pipeline.max_concurrency):
                drawn[admitted] = self.admit(admitted)
                admitted += 1
            if cfg.pipeline.late != "wait" and self.target < admitted and self.version >= self.target - 1:
                late += self.live.late(self.target, eta, steps, cfg.pipeline.late)  # the trainers wait for it
            while self.target < admitted and self.live.done(self.target):
                kept = self.finished(self.target)
                first, cursor = drawn.pop(self.target)
                cursor = {**cursor, "retry": self.live.undelivered(self.target)}  # moved on: drawn again on resume
                self.send(self.target, kept, first, busy, cursor,
                          {"reprefill_tokens": self.live.reprefilled, "late_groups": late})
                self.live.reprefilled, busy, late = 0, 0.0, 0
                self.target += 1
                self.timer.new_step(self.target)
            if self.live.running():
                start = time.perf_counter()
                with self.timer.phase("engine_step"):
                    self.live.step()
                busy += time.perf_counter() - start
            elif self.ended:
                return
            elif not self.take([self.versions.wait()]):
                return

    def admit(self, target: int) -> tuple[int, dict]:
        """Draw `target`'s positions (with dynamic sampling its share x (1 + pipeline.oversample), the same
        count on every rollout rank, so their draws stay one stream; after a resume, first the positions
        the checkpoint's step had moved on) and start its groups; its first position and the cursor after it."""
        sampler = self.rollout.sampler
        first = sampler.state_dict()["offset"]
        positions, self.retry = [*self.retry, *sampler.next_positions(self.draws())], []
        prompts = [list(self.rollout.items[sampler.item(p)].prompt_ids) for p in positions]
        self.live.admit(target, positions, prompts)
        return first, sampler.state_dict()

    def draws(self) -> int:
        """Prompts a target draws on this rank: its share, with dynamic sampling x (1 + pipeline.oversample)."""
        if not self.cfg.algorithm.dynamic_sampling:
            return self.rollout.per_rank
        return round(self.rollout.per_rank * (1 + self.cfg.pipeline.oversample))

    def finished(self, target: int) -> Rollouts:
        """A finished target's groups as sent: with dynamic sampling scored here, and only those whose
        rewards differ (DAPO's filter, one round)."""
        positions, samples = self.live.take(target)
        items = [self.rollout.items[self.rollout.sampler.item(p)] for p in positions]
        out = Rollouts(self.cfg.algorithm.group_size, items, samples)
        out.stats.rounds, out.stats.generated_groups = 1, len(items)
        if not self.cfg.algorithm.dynamic_sampling:
            return out
        with self.timer.phase("reward"), self.live.pool_lock:
            out.rewards = self.rollout.score(out)
        kept = Rollouts(out.group_size, stats=out.stats)
        kept.keep_groups(out, dynamic_sampling_keep(out.rewards))
        return kept

    def take(self, messages: list[tuple[dict, list | None]]) -> bool:
        """Versions and controls that arrived: the newest weights applied (what runs is cut and continued
        under them), the controls noted; False when the run stops here."""
        newest = None
        for message, tensors in messages:
            if message["kind"] == "weights":
                self.version = max(self.version, message["version"])
                newest = (message, tensors) if tensors is not None else newest
            elif not self.goes_on(message):
                self.live.drop()
                return False
            else:
                self.ended = message["step"] >= self.cfg.run.steps
        if newest is not None:
            announce, tensors = newest
            version = announce["version"]

            def load() -> None:  # nothing runs here: the probe compares the version held, or the one loaded
                self.answer_probe()
                self.load(announce, tensors)
                self.answer_probe()

            p = self.cfg.pipeline
            with self.timer.phase("receive"):
                if p.kv_after_update == "keep" and self.live.running() and not (
                        p.recompute_every and version % p.recompute_every == 0):
                    # the samples go on under it; the probe waits for an engine with nothing running
                    self.load(announce, tensors, keep_running=True)
                else:
                    self.live.recompute(load)
        return True
