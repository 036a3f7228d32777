"""How the ranks are laid out: the parallel degrees, decided once, and the device meshes.

Every rank builds the same `ParallelLayout` from the world size and the config, before any
model loads, so a layout that cannot work (a shard degree that does not divide the world)
stops every rank with the same one-line error. The policy, the KL reference and the critic
all take their FSDP2 mesh from here instead of building process groups of their own.

  world = replicate x shard      FSDP2 shards parameters over `shard` consecutive ranks and
                                 replicates across the `replicate` groups (HSDP); shard = world
                                 is plain FSDP, shard = 1 is full replicas (DDP-like).
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

    @classmethod
    def from_config(cls, model: ModelConfig, dist: DistInfo, engine_tp: int = 1) -> "ParallelLayout":
        ranks = shard_ranks(model)  # null: -1 for a model you name, 1 for the built-in small ones
        shard = dist.world_size if ranks == -1 else ranks
        layout = cls(dist.world_size, dist.rank, dist.device, shard, engine_tp, model.replica_grad_sync)
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
        if self.shard < 1 or self.world_size % self.shard:
            raise ConfigError(f"model.shard_ranks={self.shard} does not divide the world size {self.world_size}")
        if self.engine_tp < 1 or self.world_size % self.engine_tp:
            raise ConfigError(f"rollout.tensor_parallel_size={self.engine_tp} does not divide the world size "
                              f"{self.world_size}")

    @property
    def replicate(self) -> int:
        return self.world_size // self.shard

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
        rank alone for replicas whose gradients the bucketed reducer averages."""
        if self.shard == self.world_size:
            return init_device_mesh(self.device.type, (self.world_size,))
        mesh = init_device_mesh(self.device.type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))
        return mesh["shard"] if self.bucketed_replicas else mesh

    @functools.cached_property
    def replica_group(self):
        """A process group over all ranks for the bucketed reducer's all-reduces, so they never
        interleave with other collectives of the default group. Collective to create: every rank
        builds its models at the same point."""
        import torch.distributed as dist

        return dist.new_group(backend="nccl" if self.device.type == "cuda" else "gloo")
