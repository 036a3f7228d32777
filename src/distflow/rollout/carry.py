"""The carry buffer: groups cut at a step boundary, waiting to continue after the resync.

It is checkpoint state, written as data (rank_<r>.json), never pickled: at a boundary the engine
is empty and every carried group is plain token ids, logprobs and versions, which re-prefilling
turns back into the engine state it had, so a resume continues bit for bit. A resized resume pools
every rank's buffer and deals the groups by position (distflow.rollout.schedule.deal): none is
trained twice or lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.rollout.schedule import deal
from distflow.sample import Sample, sample_from_data, sample_to_data


@dataclass
class CarriedGroup:
    """A group cut at a step boundary: its G samples as far as they got (some may have ended)."""

    position: int  # the prompt's place in the global stream (names its item and seeds)
    admitted: int  # the step that admitted it: it trains by admitted + eta
    cuts: int  # times it was cut (keys the seeds of its continuations)
    samples: list[Sample]
    # multi-turn episodes, cut between turns: which go on, and the turns the group has taken
    open: list[bool] | None = None
    turn: int = 0

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    def to_data(self) -> dict:
        return {"position": self.position, "admitted": self.admitted, "cuts": self.cuts,
                "samples": [sample_to_data(s) for s in self.samples], "open": self.open, "turn": self.turn}

    @staticmethod
    def from_data(d: dict) -> "CarriedGroup":
        try:
            opened = d.get("open")
            return CarriedGroup(int(d["position"]), int(d["admitted"]), int(d["cuts"]),
                                [sample_from_data(s) for s in d["samples"]],
                                None if opened is None else [bool(o) for o in opened], int(d.get("turn", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a carried group is malformed ({type(e).__name__}: {e})") from None


class CarryBuffer:
    """This rank's carried groups, as rank-scoped checkpoint state."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.groups: list[CarriedGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def state_dict(self) -> dict:
        return {"groups": [g.to_data() for g in self.groups]}  # the marker holds the world size

    def load_state_dict(self, state: dict) -> None:
        self.groups = [CarriedGroup.from_data(g) for g in state["groups"]]

    def load_pooled(self, states: list[dict]) -> None:
        """Every saving rank's buffer (a resized resume): keep the groups this rank deals to."""
        pooled = [CarriedGroup.from_data(g) for state in states for g in state["groups"]]
        pooled.sort(key=lambda g: g.position)
        self.groups = [pooled[i] for i in deal([g.position for g in pooled], self.rank, self.world_size)]
