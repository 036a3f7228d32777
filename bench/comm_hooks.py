"""Count torch.distributed traffic per rank and per training step (used by bench/comm.py).

`install()` wraps the torch.distributed collectives (and the functional collectives DTensor uses)
with counters, then attributes each call to whoever called the collective directly:

  distflow   a file of the distflow package (distflow.distributed's helpers: all_reduce,
             broadcast_object, barrier) -- the traffic the benchmark is about
  fsdp       torch/distributed/fsdp: FSDP2's parameter all-gathers and gradient reduce-scatters,
             and distflow.train.grad_sync's bucketed gradient all-reduce of replicas (the traffic
             FSDP2's native HSDP all-reduce would carry otherwise)
  dtensor    torch/distributed/tensor: DTensor redistributes -- the weight-sync full_tensor()
             gathers, and clip_grad_norm_'s scalar reduce over DTensor shards
  vllm       vLLM (its external_launcher engine shares the process group)
  other      anything else (e.g. torch.distributed.checkpoint at the final save)

Bytes are the payload this rank puts into the collective: the input tensor(s) of an all_reduce /
all_gather / reduce_scatter, the pickled object of an object collective, and for broadcasts only
on the source rank. Nested calls (broadcast_object_list -> broadcast) are counted once, at the
outermost call. distflow's helpers are also counted one level up (`helpers`), including at world
size 1 where they return without calling torch.distributed.

Steps are delimited by the trainer itself, through an observer (distflow.metrics.timer): calls
before training starts are `setup`, calls up to the end of the k-th step belong to step k, later
ones to `teardown`. Each rank writes
$DISTFLOW_COMM_OUT/rank<r>.json at exit. Nothing under src/ is modified.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pickle
import sys
import threading
from collections import defaultdict
from pathlib import Path

import torch

_local = threading.local()
STATE = {"phase": "setup", "step": 0}
# phase -> category -> function -> [calls, bytes]
COUNTS: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: [0, 0])))
HELPERS: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # phase -> helper -> [calls, bytes]

DIST_FUNCS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single", "all_gather_into_tensor",
              "all_gather_coalesced", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
              "broadcast", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
              "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
              "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
FUNCOL_FUNCS = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
                "all_gather_single", "all_gather_single_autograd", "all_gather_single_coalesced",
                "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter_single_autograd",
                "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "broadcast",
                "all_to_all_single", "permute_tensor")
SECOND_ARG_IS_INPUT = {"all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                       "all_gather_object"}
SRC_ONLY = {"broadcast", "broadcast_object_list"}
OBJECT_FUNCS = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "send_object_list"}
DISTFLOW_DIR = None  # set in install()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _pickled(x) -> int:
    try:
        return len(pickle.dumps(x))
    except Exception:  # noqa: BLE001
        return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _payload(name: str, args, kwargs) -> int:
    if name in ("barrier", "monitored_barrier", "recv", "irecv", "recv_object_list"):
        return 0
    if name in SRC_ONLY:
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        if src is not None and src != _rank():
            return 0
    if name in SECOND_ARG_IS_INPUT:
        data = args[1] if len(args) > 1 else _kw(kwargs, "input_tensor", "input", "input_list", "tensor", "obj")
    else:
        data = args[0] if args else _kw(kwargs, "tensor", "tensors", "self", "inputs", "object_list", "obj",
                                        "scatter_object_input_list")
    return _pickled(data) if name in OBJECT_FUNCS else _nbytes(data)


def _kw(kwargs: dict, *names: str):
    return next((kwargs[n] for n in names if n in kwargs), None)


def _category(filename: str) -> str:
    f = filename.replace("\\", "/")
    if DISTFLOW_DIR and f == DISTFLOW_DIR + "train/grad_sync.py":
        return "fsdp"
    if DISTFLOW_DIR and f.startswith(DISTFLOW_DIR):
        return "distflow"
    for key, cat in (("torch/distributed/fsdp", "fsdp"), ("torch/distributed/tensor", "dtensor"),
                     ("/vllm/", "vllm")):
        if key in f:
            return cat
    return "other"


def _wrap(module, name: str, prefix: str):
    orig = getattr(module, name, None)
    if orig is None or getattr(orig, "_comm_counted", False):
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(_local, "depth", 0):
            return orig(*args, **kwargs)
        _local.depth = 1
        try:
            caller = sys._getframe(1).f_code.co_filename
            entry = COUNTS[STATE["phase"]][_category(caller)][prefix + name]
            entry[0] += 1
            entry[1] += _payload(name, args, kwargs)
            return orig(*args, **kwargs)
        finally:
            _local.depth = 0

    wrapper._comm_counted = True
    setattr(module, name, wrapper)


def _wrap_helper(module, name: str, payload):
    orig = getattr(module, name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        entry = HELPERS[STATE["phase"]][name]
        entry[0] += 1
        entry[1] += payload(*args, **kwargs)
        return orig(*args, **kwargs)

    wrapper._comm_counted = True
    setattr(module, name, wrapper)
    return orig, wrapper


def install() -> None:
    global DISTFLOW_DIR
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import distflow
    import distflow.distributed as dd

    DISTFLOW_DIR = str(Path(distflow.__file__).resolve().parent) + "/"
    for n in DIST_FUNCS:
        _wrap(dist, n, "")
        _wrap(dist.distributed_c10d, n, "")
    for n in FUNCOL_FUNCS:
        _wrap(funcol, n, "funcol.")

    # distflow's own helpers, counted even when world size 1 short-circuits them.
    replaced = [
        _wrap_helper(dd, "all_reduce", lambda values, op="sum": 8 * torch.as_tensor(values, dtype=torch.float64).numel()),
        _wrap_helper(dd, "broadcast_object", lambda obj: _pickled([obj]) if _rank() == 0 else 0),
        _wrap_helper(dd, "barrier", lambda: 0),
    ]
    import distflow.metrics.loggers
    import distflow.trainer  # noqa: F401 - import every user of the helpers, then rebind their names

    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("distflow") and mod is not dd:
            for orig, new in replaced:
                for attr, val in list(vars(mod).items()):
                    if val is orig:
                        setattr(mod, attr, new)

    distflow.metrics.timer.PROCESS_OBSERVERS.append(StepWatch())
    atexit.register(_dump)


class StepWatch:
    """An observer of the run (distflow.metrics.timer): which step the collectives belong to."""

    def on_train_start(self, step: int) -> None:
        STATE["step"], STATE["phase"] = 0, "step 1"

    def on_step_end(self, step: int, metrics: dict) -> None:
        STATE["step"] += 1
        STATE["phase"] = f"step {STATE['step'] + 1}"

    def on_run_end(self, trainer) -> None:
        STATE["phase"] = "teardown"


def _dump() -> None:
    out = os.environ.get("DISTFLOW_COMM_OUT")
    if not out:
        return
    steps = STATE["step"]
    phases = {}
    for phase in set(COUNTS) | set(HELPERS):
        # calls after the last logged step (the final checkpoint, export...) are teardown
        key = phase
        if phase.startswith("step ") and int(phase.split()[1]) > steps:
            key = "teardown"
        p = phases.setdefault(key, {"collectives": {}, "helpers": {}})
        for cat, funcs in COUNTS.get(phase, {}).items():
            for fn, (calls, nbytes) in funcs.items():
                e = p["collectives"].setdefault(cat, {}).setdefault(fn, [0, 0])
                e[0] += calls
                e[1] += nbytes
        for fn, (calls, nbytes) in HELPERS.get(phase, {}).items():
            e = p["helpers"].setdefault(fn, [0, 0])
            e[0] += calls
            e[1] += nbytes
    Path(out).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    with open(Path(out) / f"rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "steps": steps,
                   "phases": phases}, f, indent=1)
