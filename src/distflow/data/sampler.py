"""Deterministic per-rank sharding of dataset indices, with a reshuffle every epoch."""

from __future__ import annotations

import torch

from distflow.config import ConfigError


class ShardedSampler:
    """Hands out this rank's item indices, a few at a time, epoch after epoch.

    Epoch e is a permutation of range(num_items) drawn from a torch.Generator seeded with
    seed + e (the identity if not shuffle); rank r takes positions r, r + W, r + 2W, ... of it.
    The order is a pure function of (seed, epoch, rank, world_size), so every rank computes its
    share alone, with no communication, and a run resumes exactly from (epoch, offset).

    When num_items is not a multiple of W, the last num_items % W positions of each epoch's
    permutation are dropped, so that all ranks take the same number of steps per epoch. With
    shuffling the dropped items differ from epoch to epoch, so none is skipped for good.
    """

    def __init__(self, num_items: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if num_items < world_size:
            raise ConfigError(f"dataset has {num_items} items, fewer than the {world_size} ranks")
        self.num_items, self.rank, self.world_size = num_items, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.per_rank = num_items // world_size  # items this rank sees per epoch
        self._epoch, self._offset = 0, 0
        self._cache: tuple[int, list[int]] | None = None  # (epoch, this rank's indices)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _shard(self) -> list[int]:
        if self._cache is None or self._cache[0] != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self._epoch)
                order = torch.randperm(self.num_items, generator=g).tolist()
            else:
                order = list(range(self.num_items))
            self._cache = (self._epoch, order[: self.per_rank * self.world_size][self.rank :: self.world_size])
        return self._cache[1]

    def next_indices(self, k: int) -> list[int]:
        """This rank's next k item indices, moving into the next epoch(s) when one runs out."""
        out: list[int] = []
        while len(out) < k:
            take = self._shard()[self._offset : self._offset + k - len(out)]
            out += take
            self._offset += len(take)
            if self._offset == self.per_rank:
                self._epoch, self._offset = self._epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "offset": self._offset, "num_items": self.num_items,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, offset); the other keys must match, or positions would mean other items."""
        for key in ("num_items", "world_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}")
        if not 0 <= state["offset"] < self.per_rank:
            raise ValueError(f"sampler offset {state['offset']} is not in [0, {self.per_rank})")
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])
