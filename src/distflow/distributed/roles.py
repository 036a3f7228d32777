"""Role-split ranks (pipeline.mode=split): which ranks train, which generate, and the groups between them.

With W ranks and R = pipeline.rollout_ranks, ranks 0..T-1 (T = W - R) train and T..W-1 generate.
Trainers come first so that a trainer's rank within its role is its global rank: rank 0 still logs
and writes checkpoint metadata, and FSDP's mesh is the first T ranks. Rollout rank j (its index
among the rollout ranks) takes its weights from trainer j mod T, which broadcasts them to its
"rollout set" over a group of its own.

`take_roles` creates every group on every rank in one fixed order (creating a process group is
collective over the world), including the layout's FSDP mesh and replica group, and then scopes
distflow's collectives to this rank's role (distflow.distributed.collectives.enter_scope): from
there on no collective spans both roles. Between roles only point-to-point messages
(distflow.pipeline.links) and the weight broadcasts travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from distflow.distributed.collectives import DistInfo, RoleScope, enter_scope
from distflow.distributed.layout import ParallelLayout


@dataclass(frozen=True)
class Roles:
    """The split of `world_size` ranks: pure, the same on every rank."""

    world_size: int
    rollout_ranks: int

    @property
    def trainers(self) -> int:
        return self.world_size - self.rollout_ranks

    def is_trainer(self, rank: int) -> bool:
        return rank < self.trainers

    def rollout_index(self, rank: int) -> int:
        """A rollout rank's number among the rollout ranks (the sampler's and the seeds' rank)."""
        return rank - self.trainers

    def publisher(self, rank: int) -> int:
        """The trainer that sends rollout rank `rank` its weights and the run's control messages."""
        return self.rollout_index(rank) % self.trainers

    def rollout_set(self, trainer: int) -> list[int]:
        """The rollout ranks (global) that `trainer` publishes to; empty when R < T and it has none."""
        return [self.trainers + j for j in range(self.rollout_ranks) if j % self.trainers == trainer]

    def trainer_of(self, position: int, first: int) -> int:
        """The trainer that trains a group: stream position `position` of a step whose positions start at
        `first`. Trainer t gets the positions a sync run on T ranks gives rank t (distflow.tasks.sampler)."""
        return (position - first) % self.trainers

    def role_ranks(self, rank: int) -> tuple[int, ...]:
        return tuple(range(self.trainers)) if self.is_trainer(rank) else tuple(range(self.trainers, self.world_size))


@dataclass
class RoleGroups:
    """This rank's view of the split: its role's group, the weight groups and the message group."""

    roles: Roles
    rank: int
    role_group: object
    weight_groups: dict[int, object]  # trainer -> the group of it and its rollout set (where that is not empty)
    link_group: object  # gloo over every rank: the point-to-point messages between roles

    @property
    def is_trainer(self) -> bool:
        return self.roles.is_trainer(self.rank)

    def role_dist(self, dist_info: DistInfo) -> DistInfo:
        """`dist_info` with the rank and world size of this rank's role (a rollout rank's sampler,
        seeds and dynamic-sampling counts are the rollout ranks')."""
        ranks = self.roles.role_ranks(self.rank)
        return dataclasses.replace(dist_info, rank=ranks.index(self.rank), world_size=len(ranks))


def take_roles(layout: ParallelLayout, backend: str) -> RoleGroups:
    """Collective over the world: every group of the split, then this rank's collectives scoped to its
    role. `backend`: the default group's (the weight broadcasts use it: nccl on CUDA, gloo on CPU)."""
    roles = Roles(layout.world_size, layout.rollout_ranks)
    rank = layout.rank
    groups = {True: dist.new_group(list(range(roles.trainers))),
              False: dist.new_group(list(range(roles.trainers, roles.world_size)))}
    weight_groups = {}
    for t in range(roles.trainers):
        members = roles.rollout_set(t)
        if members:
            weight_groups[t] = dist.new_group([t, *members], backend=backend)
    link_group = dist.new_group(backend="gloo")
    # the layout's groups too, on every rank and in this order, before any model loads
    layout.fsdp_mesh
    layout.replica_group
    layout.engine_group  # tensor-parallel engines: the trainers' (asleep) and the rollout ranks'
    mine = roles.role_ranks(rank)
    enter_scope(RoleScope(groups[roles.is_trainer(rank)], mine, mine.index(rank)))
    return RoleGroups(roles, rank, groups[roles.is_trainer(rank)], weight_groups, link_group)
