"""How the ranks are laid out: the parallel degrees, decided once, and the device meshes.

Every rank builds the same `ParallelLayout` from the world size and the config, before any
model loads, so a layout that cannot work (a shard degree that does not divide the world)
stops every rank with the same one-line error. The policy, the KL reference and the critic
all take their FSDP2 mesh from here instead of building process groups of their own.

  world = replicate x shard      FSDP2 shards parameters over `shard` consecutive ranks and
                                 replicates across the `replicate` groups (HSDP); shard = world
                                 is plain FSDP, shard = 1 is full replicas (DDP-like).
  trainers = world - rollout    pipeline.mode=split gives the last `rollout_ranks` ranks to generation:
                                 the FSDP mesh and the replica group then span the first `trainers`
                                 ranks only (replicate x shard = trainers).
  world = engines x engine_tp    consecutive groups of `engine_tp` ranks share one
                                 tensor-parallel vLLM engine (rollout.tensor_parallel_size; the
                                 same grouping vLLM's external launcher makes); 1 = every rank owns
                                 a whole engine.

Full replicas (shard = 1, replicate > 1) average their gradients either through FSDP2's native
HSDP all-reduce or, with model.replica_grad_sync=bucketed (the default), through distflow's
bucketed reducer (distflow.train.grad_sync): then each model is sharded over a one-rank mesh and the
reducer's all-reduces run over `replica_group`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distflow.config import ConfigError, ModelConfig
from distflow.distributed import DistInfo, rank_and_world
from distflow.distributed.devices import shard_ranks
from distflow.models.heads import attention_heads, tensor_parallel_problem


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    rank: int
    device: torch.device
    shard: int  # FSDP shard degree (model.shard_ranks, -1 resolved to the world size)
    engine_tp: int = 1  # ranks per rollout engine (rollout.tensor_parallel_size)
    replica_grad_sync: str = "bucketed"  # model.replica_grad_sync: bucketed | fsdp
    rollout_ranks: int = 0  # pipeline.rollout_ranks: the last ranks, which only generate (split)

    @classmethod
    def from_config(cls, model: ModelConfig, dist: DistInfo, engine_tp: int = 1,
                    rollout_ranks: int = 0) -> "ParallelLayout":
        ranks = shard_ranks(model)  # null: -1 for a model you name, 1 for the built-in small ones
        shard = dist.world_size - rollout_ranks if ranks == -1 else ranks
        layout = cls(dist.world_size, dist.rank, dist.device, shard, engine_tp, model.replica_grad_sync, rollout_ranks)
        layout.validate()
        if dist.local_world_size % engine_tp:  # torchrun numbers a node's ranks consecutively
            raise ConfigError(f"rollout.tensor_parallel_size={engine_tp} does not divide the {dist.local_world_size} "
                              "ranks per node: an engine's ranks would span nodes, and a tensor-parallel engine "
                              "all-reduces every layer; choose a size that divides the ranks per node")
        if problem := tensor_parallel_problem(engine_tp, attention_heads(model.path, model.trust_remote_code)):
            raise ConfigError(f"rollout.tensor_parallel_size={engine_tp}: {problem} ({model.path})")
        return layout

    @classmethod
    def current(cls, model: ModelConfig, device: torch.device | str = "cpu", engine_tp: int = 1) -> "ParallelLayout":
        """The layout of the already-initialised default process group (tests, benchmarks)."""
        rank, world = rank_and_world()
        info = DistInfo(rank, world, rank, world, torch.device(device), "gloo")
        return cls.from_config(model, info, engine_tp)

    def validate(self) -> None:
        if self.rollout_ranks and not 0 < self.rollout_ranks < self.world_size:
            raise ConfigError(f"pipeline.rollout_ranks={self.rollout_ranks} leaves no rank to train: it must be "
                              f"below the world size {self.world_size}")
        trainers = f"the {self.trainers} trainer ranks" if self.rollout_ranks else f"the world size {self.world_size}"
        if self.shard < 1 or self.trainers % self.shard:
            raise ConfigError(f"model.shard_ranks={self.shard} does not divide {trainers}")
        if self.engine_tp < 1 or self.world_size % self.engine_tp or self.trainers % self.engine_tp:
            raise ConfigError(f"rollout.tensor_parallel_size={self.engine_tp} does not divide {trainers}"
                              + (f" and the {self.rollout_ranks} rollout ranks" if self.rollout_ranks else ""))

    @property
    def trainers(self) -> int:
        """The ranks that train: all of them, or the first world - rollout_ranks (split)."""
        return self.world_size - self.rollout_ranks

    @property
    def replicate(self) -> int:
        return self.trainers // self.shard

    @property
    def bucketed_replicas(self) -> bool:
        """Full replicas whose gradients distflow's bucketed reducer averages (distflow.train.grad_sync)."""
        return self.shard == 1 and self.replicate > 1 and self.replica_grad_sync == "bucketed"

    @property
    def engine_ranks(self) -> list[int]:
        """The ranks that drive this rank's engine: `engine_tp` consecutive ranks, this one among them."""
        first = self.rank - self.rank % self.engine_tp
        return list(range(first, first + self.engine_tp))

    @functools.cached_property
    def engine_group(self):
        """A gloo group over `engine_ranks` (None when each rank owns its engine), for the small
        exchange of requests before each engine call. Every rank must create it at the same point:
        creating groups is collective over the whole world."""
        import torch.distributed as dist

        if self.engine_tp == 1:
            return None
        groups = [list(range(i, i + self.engine_tp)) for i in range(0, self.world_size, self.engine_tp)]
        mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
        return mine

    @functools.cached_property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh, built once: 1-D over all ranks, 2-D (replicate, shard) for HSDP, or this
        rank alone for replicas whose gradients the bucketed reducer averages. Split runs mesh the
        trainer ranks only; creating it is collective over the world, so every rank builds it
        (distflow.distributed.roles) and a rollout rank's holds no coordinate."""
        names = ("replicate", "shard")
        if not self.rollout_ranks and self.shard == self.world_size:
            return init_device_mesh(self.device.type, (self.world_size,))
        if self.rollout_ranks:
            mesh = DeviceMesh(self.device.type, torch.arange(self.trainers).view(self.replicate, self.shard),
                              mesh_dim_names=names)
            if self.rank >= self.trainers:
                return mesh
        else:
            mesh = init_device_mesh(self.device.type, (self.replicate, self.shard), mesh_dim_names=names)
        return mesh["shard"] if self.bucketed_replicas or self.replicate == 1 else mesh

    @functools.cached_property
    def replica_group(self):
        """A process group over the trainer ranks (all ranks but split runs' rollout ranks) for the
        bucketed reducer's all-reduces, so they never interleave with other collectives of the
        default group. Collective to create: every rank builds its models at the same point."""
        import torch.distributed as dist

        ranks = list(range(self.trainers)) if self.rollout_ranks else None
        return dist.new_group(ranks, backend="nccl" if self.device.type == "cuda" else "gloo")
