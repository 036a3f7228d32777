"""Where and how the ranks run: the process group and distflow's few collectives, the agreement
that stops every rank with the line of one that failed, the device a rank trains on, and the
parallel layout (FSDP shard degree, engine tensor-parallel groups)."""

from distflow.distributed.collectives import (
                                              DistInfo,
                                              RoleScope,
                                              all_reduce,
                                              barrier,
                                              broadcast_object,
                                              complete,
                                              enter_scope,
                                              global_rank,
                                              init_distributed,
                                              on_local_rank0_first,
                                              rank_and_world,
                                              role_group,
                                              shutdown,
                                              waited_s,
                                              waiting,
)
from distflow.distributed.agreement import agree, agree_failure, one_line, one_rank_may_fail

__all__ = ["DistInfo", "RoleScope", "agree", "agree_failure", "all_reduce", "barrier", "broadcast_object", "complete",
           "enter_scope", "global_rank", "init_distributed", "on_local_rank0_first", "one_line", "one_rank_may_fail",
           "rank_and_world", "role_group", "shutdown", "waited_s", "waiting"]
