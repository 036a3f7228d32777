"""Carry-over for multi-turn episodes: groups are cut between turns, never inside one.

The episodes advance in waves, as the synchronous EpisodeRunner's turn loop advances them: a wave
generates one turn for every open episode in the engine (a new group's first turn is one request
of G samples, seeded by its position; a later turn one request per episode, seeded by the group's
seed, the episode's index and the turn), then the environment answers those turns. Before each
wave the round may stop (distflow.rollout.schedule: the quota finished, no due group open); the
groups still open are carried with their tokens, mask, logprobs, versions, transcript and counters,
and take their next turn after the resync, re-prefilled under the new weights. With eta = 0 every
group runs to its end in the round that admitted it, in the synchronous loop's waves and seeds.

On a tensor-parallel engine group a wave's engine steps are agreed per step (step_unless), and a
rank whose round may stop runs empty waves until every rank's may: the first call of a wave
returns None only when no rank submitted anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config import DistflowConfig
from distflow.rollout import schedule
from distflow.rollout.base import Request, step_unless
from distflow.rollout.carry import CarriedGroup, CarryBuffer
from distflow.rollout.driver import CarrySteps, Finished
from distflow.rollout.episodes import EpisodeRunner, Episode
from distflow.sample import Sample
from distflow.seeds import derive_seed, sample_seed


@dataclass
class _Group:
    position: int
    admitted: int
    fields: dict
    episodes: list[Episode]
    open: list[bool]
    turn: int = 0  # turns taken
    resumed: bool = False  # carried in: its next turn re-prefills its context


class EpisodeCarryover(CarrySteps):
    """pipeline.mode=carryover with rollout.max_turns > 1 (see the module docstring)."""

    def __init__(self, engine, runner: EpisodeRunner, cfg: DistflowConfig, buffer: CarryBuffer, item_of):
        """`item_of(position)`: the PromptItem at a stream position (a carried group's fields)."""
        super().__init__(cfg, buffer)
        self.engine, self.runner, self.item_of, self.max_turns = engine, runner, item_of, cfg.rollout.max_turns

    # ------------------------------------------------------------------ a round
    def round(self, step: int, positions: list[int], items: list, quota: int) -> Finished:
        if self._start_round(step):
            self._admit_carried()
        for position, item in zip(positions, items):
            self.groups[position] = _Group(position, step, item.fields,
                                           [Episode(list(item.prompt_ids)) for _ in range(self.group_size)],
                                           [True] * self.group_size)
        while True:
            wave = [] if self._may_stop(step, quota) else list(self.groups.values())
            outputs = self._generate(wave)
            if outputs is None:  # every rank's round may stop
                return self._hand_out(step, quota, lambda g: [e.sample() for e in g.episodes])
            if wave:
                self._answer(wave, outputs)

    def _generate(self, wave: list[_Group]) -> dict[tuple[int, int], Sample] | None:
        """One turn for every open episode of `wave`: {(position, episode): its turn}; None when no
        rank of the engine group had a wave to run."""
        owner: dict[str, tuple[int, list[int]]] = {}
        for g in wave:
            if g.turn == 0:
                rid = str(g.position)
                owner[rid] = (g.position, list(range(self.group_size)))
                self.engine.submit(Request(rid, list(g.episodes[0].prompt_ids), self.group_size,
                                           sample_seed(self.seed, g.position)))
                continue
            for k, ep in enumerate(g.episodes):
                if g.open[k]:
                    rid = f"{g.position}.{k}.t{g.turn + 1}"
                    owner[rid] = (g.position, [k])
                    self.engine.submit(Request(rid, ep.prompt_ids + ep.ids, 1,
                                               derive_seed(sample_seed(self.seed, g.position), k, g.turn + 1)))
                    if g.resumed:
                        self.metrics["reprefill_tokens"] += len(ep.prompt_ids) + len(ep.ids)
            g.resumed = False
        outputs, stepped = {}, False
        while (out := step_unless(self.engine, len(outputs) == sum(len(ks) for _, ks in owner.values()))) is not None:
            stepped = True
            for rid, samples in out:
                position, ks = owner[rid]
                outputs.update({(position, k): s for k, s in zip(ks, samples)})
        return outputs if stepped or owner else None

    def _answer(self, wave: list[_Group], outputs: dict[tuple[int, int], Sample]) -> None:
        """The environment answers the wave's turns (in the synchronous loop's episode order)."""
        stepping = []
        for g in wave:
            g.turn += 1
            for k, ep in enumerate(g.episodes):
                if g.open[k]:
                    g.open[k] = self.runner.add_turn(ep, outputs[(g.position, k)])
                    if g.open[k]:
                        stepping.append((g, k))
        results, _ = self.runner.pool.steps([(g.fields, g.episodes[k].info.transcript) for g, k in stepping])
        for (g, k), result in zip(stepping, results):
            g.open[k] = self.runner.add_observation(g.episodes[k], result, last_turn=g.turn == self.max_turns)
        for g in wave:
            if not any(g.open):
                self._complete(g)

    # ------------------------------------------------------------------ the step boundary
    def _admit_carried(self) -> None:
        carried, self.buffer.groups = self.buffer.groups, []
        for i in schedule.admit_order([(c.admitted, c.position) for c in carried]):
            c = carried[i]
            g = _Group(c.position, c.admitted, self.item_of(c.position).fields,
                       [Episode.of(s) for s in c.samples], list(c.open or [False] * len(c.samples)), c.turn, True)
            if any(g.open):
                self.groups[g.position] = g
            else:  # finished, held back beyond a quota
                self.finished.append(g)

    def end_step(self, step: int) -> dict[str, float]:
        """Carry every group still open (the engine is empty: waves end whole) and the held ones."""
        held = [CarriedGroup(g.position, g.admitted, 0, [e.sample() for e in g.episodes], list(g.open), g.turn)
                for g in self.finished]
        return self._carry(held + [CarriedGroup(g.position, g.admitted, 1, [e.sample() for e in g.episodes],
                                                list(g.open), g.turn) for g in self.groups.values()])
