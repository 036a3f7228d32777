"""Process-group set-up and the few collectives distflow itself calls.

Every rank runs the same program (SPMD). The process group is created before anything else,
because the vLLM engine (external_launcher) and FSDP2 both reuse it. All cross-rank traffic
outside FSDP goes through the helpers below, so it can be counted and reasoned about.

Each helper also runs under `waiting()`, which adds its wall time to this process's wait clock:
a rank that reaches a collective first blocks there until the last one arrives, so on the
small payloads distflow sends this is the time the rank waited for its peers (the trainer
reports it per step as timing/wait_s). FSDP's own collectives are not on the clock. On NCCL a
call returns once the collective is queued on the device, not when it completes: `complete()`
holds the clock until the work handles report completion, so the wait is counted where it
happens rather than in the next blocking copy to the host.
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from distflow.distributed.devices import CudaState, choose_backend, choose_device

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    owns_group: bool = True  # this call created the default group (it is this process's to destroy)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Create the default process group from torchrun's env (or a 1-process group without it).

    backend/device "auto": nccl + cuda:LOCAL_RANK when torch can use CUDA, else gloo + cpu; but
    a rank that sees GPUs it cannot use stops with a ConfigError instead (distflow.distributed.devices).
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    device = choose_device(device, CudaState.probe(), os.environ, local_rank, local_world)
    backend = choose_backend(backend, device)
    dev = torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        # Leave each rank an equal share of the cores unless the user pinned threads.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    owns_group = not dist.is_initialized()  # a caller's group (tests, notebooks) stays the caller's
    if owns_group:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=_attempt_store(world, timeout),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistInfo(rank, world, local_rank, local_world, dev, backend, owns_group)


def _attempt_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun restarts, a store namespace per attempt.

    torchrun reuses its agent's TCPStore across restarts; without a per-attempt prefix a
    restarted rank can read a dead peer's gloo address from the previous attempt and fail
    to connect. None means: let init_process_group use env:// as usual.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"distflow/attempt_{attempt}", base)


_waited_s = 0.0  # this process's wait clock
_depth = 0  # nesting of waiting() blocks


@contextmanager
def waiting():
    """Adds the block's wall time to the wait clock (`waited_s`); nested blocks count once."""
    global _waited_s, _depth
    _depth += 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _waited_s += time.perf_counter() - start


def complete(works: list) -> None:
    """Block until every work handle (from an `async_op=True` call) has completed. `wait()` alone
    blocks the host on gloo, but on NCCL it only orders the current CUDA stream after the
    collective; polling `is_completed()` (which queries the collective's CUDA events) waits for
    the device as well, without synchronising unrelated work on the stream."""
    for work in works:
        work.wait()
    while not all(work.is_completed() for work in works):
        time.sleep(_POLL_S)


_POLL_S = 50e-6


def waited_s() -> float:
    """Seconds this process has spent in distflow's collectives so far (monotonic)."""
    return _waited_s


@dataclass(frozen=True)
class RoleScope:
    """The group this process's collectives run on once the ranks took roles (pipeline.mode=split):
    a trainer's all_reduces, agreements and checkpoints are the trainers' alone, a rollout rank's the
    rollout ranks'. `ranks`: the group's global ranks, in order; `rank`: this rank's index among them."""

    group: object
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


_scope: RoleScope | None = None  # None: the whole world (sync and carry-over runs)


def enter_scope(scope: RoleScope | None) -> None:
    """From here on distflow's collectives (and `role_group`'s users) run on `scope`'s group."""
    global _scope
    _scope = scope


def role_group():
    """The process group of this rank's role; None means the default group (no roles)."""
    return _scope.group if _scope is not None else None


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) within this rank's role, or of the default group; (0, 1) without a group."""
    if _scope is not None:
        return _scope.rank, _scope.size
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def global_rank(role_rank: int) -> int:
    """The global rank of a rank numbered within this rank's role (the number a user sees in the logs)."""
    return _scope.ranks[role_rank] if _scope is not None else role_rank


def _alone() -> bool:
    return not dist.is_initialized() or rank_and_world()[1] == 1


def all_reduce(values: torch.Tensor | list[float] | float, op: str = "sum") -> torch.Tensor:
    """All-reduce a small float64 vector on CPU-equivalent semantics; returns a new CPU tensor.

    On nccl the data must live on the GPU; the helper moves it there and back.
    """
    t = torch.as_tensor(values, dtype=torch.float64).clone().reshape(-1)
    if _alone():
        return t
    if dist.get_backend() == "nccl":
        t = t.cuda()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    with waiting():
        complete([dist.all_reduce(t, op=ops[op], group=role_group(), async_op=True)])
    return t.cpu()


def broadcast_object(obj):
    """Rank 0's value of a small picklable object, on every rank (of the role: its first rank's)."""
    if _alone():
        return obj
    box = [obj]
    with waiting():
        dist.broadcast_object_list(box, group=role_group(), group_src=0)
    return box[0]


def on_local_rank0_first(fn: Callable[[], T], local_rank: int) -> T:
    """fn() on local rank 0 first, while the node's other ranks wait at a barrier, then on them: a
    built-in model is built or converted once per node (a hub model downloaded once), and the others
    only find the finished folder. When fn() fails on local rank 0 the others still pass the
    barrier and run it themselves, so every rank stops with its own error instead of waiting."""
    if local_rank == 0:
        try:
            result = fn()
        except Exception:
            barrier()
            raise
    barrier()
    return result if local_rank == 0 else fn()


def barrier() -> None:
    if not _alone():
        with waiting():
            complete([dist.barrier(group=role_group(), async_op=True)])


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
