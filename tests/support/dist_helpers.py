"""Run a function in N real gloo processes (torch.multiprocessing), for tests."""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Modules a rank would otherwise import itself, ~5 s of CPU per rank, and ~3 s more for each rank
# that builds a vLLM engine (its engine and worker modules load lazily, 2,500 of them): ranks fork
# from a server that imported them once (multiprocessing's forkserver), so a rank starts in a
# fraction of a second.
PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "distflow.trainer", "distflow.job",
           "distflow.rollout.hf_engine", "hydra", "hydra._internal.config_loader_impl"]
if importlib.util.find_spec("vllm") is not None:
    PRELOAD += ["vllm", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker"]
# Variables those modules read at import (the Hugging Face libraries' cache and offline settings):
# when a test changes one, its ranks are spawned fresh instead. Every other variable reaches the
# ranks as the test set it (`_entry`).
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")
_server_env: dict[str, str] | None = None


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(READ_AT_IMPORT)}


def _context():
    """forkserver with PRELOAD imported, or spawn when READ_AT_IMPORT variables differ from the ones
    the server started with."""
    global _server_env
    if _server_env is None:
        _server_env = _import_time_env()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("forkserver" if _import_time_env() == _server_env else "spawn")


def _entry(rank: int, world: int, port: int, fn, args, errq, results, environ: dict) -> None:
    os.environ.clear()  # the test's environment now, not the one the fork server started with
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    # one thread per rank, as torchrun gives each: torch is imported already (by this module, and
    # by the pickled target's), so the variable above comes too late for this process's own pool
    torch.set_num_threads(1)
    faulthandler.enable()  # a native abort prints every thread's Python stack into the test's output
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        if dist.is_initialized():  # (a worker may have shut its group down itself)
            dist.barrier()  # no rank tears its group down while a peer still has traffic in flight
        if rank == 0:
            # plain pickle: tensors travel as bytes, not as shared memory that dies with this process
            results.send_bytes(pickle.dumps(result))
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300):
    """Run fn(rank, world_size, *args) on world_size gloo ranks and return rank 0's return value
    (`gathered` hands rank 0 every rank's); re-raise the first failure.

    `timeout` bounds the whole call (one deadline shared by every rank, not one per rank), and no
    child outlives the call: any rank still running when it returns or raises (a hang, an error
    in a sibling, a KeyboardInterrupt) is killed and reaped in the `finally` below.
    """
    ctx = _context()
    errq = ctx.SimpleQueue()
    reader, results = ctx.Pipe(duplex=False)  # rank 0's return value
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errq, results, dict(os.environ)))
             for r in range(world_size)]
    alive: list = []
    failure = None  # (rank, traceback) of the first rank to report one
    result = None
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.start()
        # Wait for every rank against the one deadline; stop early once a rank has reported a
        # failure (its peers would otherwise sit in a collective until the deadline). The report
        # is read while its writer still lives, so a long traceback is never cut off by the kill;
        # rank 0's result likewise (a result larger than a pipe's buffer waits for its reader).
        while True:
            if not errq.empty():
                failure = errq.get()
                break
            if reader.poll():
                result = pickle.loads(reader.recv_bytes())
            running = [p for p in procs if p.is_alive()]
            left = deadline - time.monotonic()
            if not running or left <= 0:
                break
            wait([p.sentinel for p in running] + [reader], timeout=min(left, 0.5))
        alive = [p for p in procs if p.is_alive()]
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(30)
    if failure is None and not alive and not errq.empty():  # reported just as the last rank exited
        failure = errq.get()
    if failure is not None:
        rank, tb = failure
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    assert not alive, f"{len(alive)} rank(s) hung past {timeout}s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return pickle.loads(reader.recv_bytes()) if result is None and reader.poll() else result


def gathered(value):
    """Every rank's `value`, in rank order, on every rank (a worker returns it for rank 0's report)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
