"""Deterministic per-rank sharding of dataset indices, with a reshuffle every epoch."""

from __future__ import annotations

import torch

from distflow.config import ConfigError


class ShardedSampler:
    """Hands out this rank's item indices, a few at a time, epoch after epoch.

    All ranks read one global stream: epoch e's permutation of range(num_items) (a
    torch.Generator seeded with seed + e; the identity if not shuffle), then epoch e+1's, and
    so on. A call for k items on W ranks consumes the next k*W stream positions, and rank r
    takes positions r, r + W, ... of them. So each epoch's items are dealt out across the
    ranks exactly once — also when num_items is not a multiple of W (a rank may then cross
    into the next epoch a step before another). Everything is a pure function of (seed,
    stream offset, rank, world_size): no communication, and a run resumes exactly. The offset
    is global, so a run resumed on another number of ranks continues the same stream: every
    item of the epoch is still dealt out once.
    """

    def __init__(self, num_items: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if num_items < 1:
            raise ConfigError("the dataset has no items")
        self.num_items, self.rank, self.world_size = num_items, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self._offset = 0  # global stream positions consumed (the same on every rank)
        self._cache: tuple[int, list[int]] | None = None  # (epoch, its permutation)
        self.last_positions: list[tuple[int, int]] = []  # (epoch, item) of the last call, for logs

    @property
    def epoch(self) -> int:
        return self._offset // self.num_items

    def _item(self, position: int) -> int:
        epoch, i = divmod(position, self.num_items)
        if self._cache is None or self._cache[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.num_items, generator=torch.Generator().manual_seed(self.seed + epoch))
                self._cache = (epoch, order.tolist())
            else:
                self._cache = (epoch, list(range(self.num_items)))
        return self._cache[1][i]

    def next_positions(self, k: int) -> list[int]:
        """This rank's next k stream positions (the same call on every rank advances all alike); a
        position names its item (`item`) and keys its samples' seeds, whatever rank draws it."""
        positions = [self._offset + self.rank + j * self.world_size for j in range(k)]
        self.last_positions = [(p // self.num_items, self._item(p)) for p in positions]
        self._offset += k * self.world_size
        return positions

    def item(self, position: int) -> int:
        """The item index at a stream position."""
        return self._item(position)

    def next_indices(self, k: int) -> list[int]:
        """This rank's next k item indices."""
        return [self._item(p) for p in self.next_positions(k)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self._offset, "num_items": self.num_items,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the stream offset; the data keys must match, or positions would mean other
        items. The world size may differ (a resized resume): the offset counts global positions."""
        for key in ("num_items", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}")
        if state["offset"] < 0:
            raise ValueError(f"sampler offset {state['offset']} is negative")
        self._offset = int(state["offset"])
