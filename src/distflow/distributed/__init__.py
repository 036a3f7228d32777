"""Where and how the ranks run: the process group and distflow's few collectives, the device a
rank trains on, and the parallel layout (FSDP shard degree, engine tensor-parallel groups)."""

from distflow.distributed.collectives import (
                                              DistInfo,
                                              all_reduce,
                                              barrier,
                                              broadcast_object,
                                              complete,
                                              init_distributed,
                                              on_local_rank0_first,
                                              rank_and_world,
                                              shutdown,
                                              waited_s,
                                              waiting,
)

__all__ = ["DistInfo", "all_reduce", "barrier", "broadcast_object", "complete", "init_distributed", "on_local_rank0_first",
           "rank_and_world", "shutdown", "waited_s", "waiting"]
