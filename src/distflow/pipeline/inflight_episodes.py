"""Multi-turn episodes (task.env) on an inflight rollout rank (distflow.pipeline.inflight).

Every episode is a small state machine: a turn generating in the engine, the environment answering it,
or done. Episodes do not wait for each other: one whose answer has come takes its next turn while the
others generate or wait. The seeds are the synchronous EpisodeRunner's (a group's first turn one request
of G samples seeded by its position, a later turn one request per episode seeded by the group's seed,
the episode's index and the turn), so with no version applied meanwhile every episode is the sync run's.

Where a version is applied (recompute), a running turn is aborted and continued under it: the episode so
far and the turn's tokens re-prefilled, the rest of the turn's rollout.max_new_tokens to go, seeded by
its position, index and cut count; every token keeps the version that sampled it. An episode waiting for
its environment holds no request, so a version applied meanwhile changes nothing of it until its next
turn, which runs under the newest weights.

pipeline.env_wait says when the environment answers (`EnvAnswers`): `wave`, the turns that finished in one
engine step are answered together, the engine waiting (the synchronous loop's batching); `free`, each
finished turn goes to a thread that runs the environment's steps in the task's workers while the engine
steps the other episodes, and an episode's next turn is submitted as its answer arrives.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from distflow.pipeline.inflight import InflightGroups, _Group
from distflow.rollout.base import Request
from distflow.rollout.driver import continued
from distflow.rollout.episodes import Episode, EpisodeRunner
from distflow.rollout.schedule import sample_done
from distflow.sample import Sample
from distflow.seeds import derive_seed, sample_seed


class EnvAnswers:
    """The environment's steps for finished turns, keyed by (position, episode): answered in the caller's
    thread at `flush` (wave), or in a thread of their own as they come (free). `lock` serializes the
    task's workers, which the rank's own scoring (dynamic sampling) uses too."""

    def __init__(self, pool, free: bool):
        self.pool, self.free, self.lock = pool, free, threading.Lock()
        self.asked: list[tuple[tuple[int, int], tuple]] = []
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.outstanding, self.closed, self.wake = 0, False, threading.Condition()
        if free:
            threading.Thread(target=self._serve, name="distflow-env", daemon=True).start()

    def ask(self, key: tuple[int, int], call: tuple) -> None:
        with self.wake:
            self.asked.append((key, call))
            self.outstanding += 1
            self.wake.notify()

    def flush(self) -> None:
        """wave: answer every turn asked since the last flush, now."""
        if not self.free and self.asked:
            self._answer(self._taken())

    def ready(self, block: bool) -> list[tuple[tuple[int, int], tuple]]:
        """The answers that have come; with `block`, wait a little for one when none has."""
        out = []
        try:
            out.append(self.answers.get(timeout=0.05) if block and self.outstanding else self.answers.get_nowait())
            while True:
                out.append(self.answers.get_nowait())
        except queue.Empty:
            pass
        for key, result in out:
            if isinstance(result, BaseException):  # the thread's error, raised where the loop runs
                raise result
        self.outstanding -= len(out)
        return out

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()

    def _taken(self) -> list:
        with self.wake:
            asked, self.asked = self.asked, []
        return asked

    def _answer(self, asked: list) -> None:
        with self.lock:
            results, _ = self.pool.steps([call for _, call in asked])
        for (key, _), result in zip(asked, results):
            self.answers.put((key, result))

    def _serve(self) -> None:
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.asked or self.closed)
                if self.closed:
                    return
            asked = self._taken()
            try:
                self._answer(asked)
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread
                self.answers.put((asked[0][0], e))
                return


class InflightEpisodes(InflightGroups):
    """An inflight rank's groups when each sample is an episode (see the module docstring)."""

    def __init__(self, engine, seed: int, group_size: int, budget: int, runner: EpisodeRunner,
                 fields_of: Callable[[int], dict], env_wait: str):
        super().__init__(engine, seed, group_size, budget)
        self.runner, self.fields_of, self.max_turns = runner, fields_of, runner.cfg.max_turns
        self.episodes: dict[int, list[Episode]] = {}  # position -> its group's episodes
        self.env = EnvAnswers(runner.pool, free=env_wait == "free")
        self.pool_lock = self.env.lock

    def admit(self, target: int, positions: list[int], prompts: list[list[int]]) -> None:
        for position, prompt in zip(positions, prompts):
            self.episodes[position] = [Episode(list(prompt)) for _ in range(self.group_size)]
        super().admit(target, positions, prompts)

    def running(self) -> bool:
        return bool(self.owner) or self.env.outstanding > 0

    def step(self) -> None:
        """An engine step (the turns it finished go to the environment), or, with nothing in the engine, a
        short wait for the environment; then every episode answered takes its next turn."""
        if self.owner:
            for rid, samples in self.engine.step():
                group = self.groups[self.owner.pop(rid)]
                for k, s in zip(group.requests.pop(rid), samples):
                    self._turn_done(group, k, s)
            self.env.flush()
        for (position, k), result in self.env.ready(block=not self.owner):
            if (group := self.groups.get(position)) is None:  # dropped (pipeline.late=drop) meanwhile
                continue
            ep = self.episodes[position][k]
            if self.runner.add_observation(ep, result, last_turn=ep.info.turns == self.max_turns):
                turn = ep.info.turns + 1
                self._request(group, k, f"{position}.{k}.t{turn}", ep.prompt_ids + ep.ids,
                              derive_seed(sample_seed(self.seed, position), k, turn))
            else:
                self._close(group, k)

    def _close(self, group: _Group, k: int) -> None:
        group.samples[k] = self.episodes[group.position][k].sample()
        group.samples[k].position = group.position

    def _turn_done(self, group: _Group, k: int, s: Sample) -> None:
        turn, group.before[k] = continued(group.before[k], s, group.position), None
        ep = self.episodes[group.position][k]
        if self.runner.add_turn(ep, turn):
            self.env.ask((group.position, k), (self.fields_of(group.position), ep.info.transcript))
        else:  # cut at the response budget: the episode ends
            self._close(group, k)

    def _request(self, group: _Group, k: int, rid: str, prompt: list[int], seed: int, max_tokens=None) -> None:
        group.requests[rid] = [k]
        self._submit(Request(rid, prompt, 1, seed, max_tokens=max_tokens), group.position)

    def recompute(self, load: Callable[[], None]) -> None:
        """Abort the running turns (keeping their tokens), `load` a version, and continue each unfinished
        one under it; a turn that had ended goes to the environment."""
        cut = self.engine.abort(list(self.owner))
        load()
        for rid in sorted(cut, key=lambda r: (self.owner[r], r)):
            group = self.groups[self.owner.pop(rid)]
            cuts = group.cuts = group.cuts + 1
            for k, s in zip(group.requests.pop(rid), cut[rid]):
                part = continued(group.before[k], s, group.position)
                if sample_done(part, self.budget):
                    group.before[k] = None
                    self._turn_done(group, k, part)
                    continue
                group.before[k], ep = part, self.episodes[group.position][k]
                context = ep.prompt_ids + ep.ids + part.response_ids
                self._request(group, k, f"{group.position}.{k}.c{cuts}", context,
                              sample_seed(self.seed, group.position, k, cuts), self.budget - len(part.response_ids))
                self.reprefilled += len(context)
        self.env.flush()

    def late(self, target: int, eta: int, last: int, rule: str) -> int:
        n = super().late(target, eta, last, rule)
        self.episodes = {p: eps for p, eps in self.episodes.items() if p in self.groups}
        return n

    def take(self, target: int) -> tuple[list[int], list[Sample]]:
        positions, samples = super().take(target)
        for p in positions:
            del self.episodes[p]
        return positions, samples

    def drop(self) -> None:
        super().drop()
        self.episodes = {}
        self.env.close()

    def close(self) -> None:
        self.env.close()
