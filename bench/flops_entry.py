"""recipes/grpo.py with this machine's fp32 matmul FLOP/s measured inside the same run (bench/flops.py).

Trainer.train is wrapped: after the models are loaded (the process group exists) and again after
the last step, every rank multiplies square fp32 matrices at the same time, with the thread count
the run uses (see measure(): the machine's aggregate peak for this process layout). Rank 0
writes the numbers to $DISTFLOW_FLOPS_OUT. The recipe itself runs unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"


def measure(sizes: list[int], reps: int, inner: int = 3) -> dict:
    """Aggregate fp32 matmul FLOP/s of all ranks running at once: each timed round starts with a
    barrier, every rank does `inner` n x n matmuls, and the round lasts as long as the slowest rank
    (so no rank can be timed while another one idles). Best of `reps` rounds per size."""
    from distflow.distributed import all_reduce, barrier

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    res = {}
    for n in sizes:
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up
        best = float("inf")
        for _ in range(reps):
            barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b, out=out)
            best = min(best, float(all_reduce(time.perf_counter() - t0, "max")))
        res[str(n)] = world * inner * 2 * n**3 / best
    return {"by_size": res, "peak": max(res.values()), "threads_per_rank": torch.get_num_threads()}


def install() -> None:
    import distflow.trainer

    sizes = [int(s) for s in os.environ.get("DISTFLOW_FLOPS_SIZES", "1024,2048").split(",")]
    reps = int(os.environ.get("DISTFLOW_FLOPS_REPS", "5"))
    orig = distflow.trainer.Trainer.train

    def train(self, *a, **k):
        before = measure(sizes, reps)
        orig(self, *a, **k)
        after = measure(sizes, reps)
        if self.dist.is_main and os.environ.get("DISTFLOW_FLOPS_OUT"):
            with open(os.environ["DISTFLOW_FLOPS_OUT"], "w") as f:
                json.dump({"before": before, "after": after, "world_size": self.dist.world_size}, f, indent=1)

    distflow.trainer.Trainer.train = train


if __name__ == "__main__":
    install()
    sys.argv[0] = str(GRPO)
    sys.path.insert(0, str(GRPO.parent))
    runpy.run_path(str(GRPO), run_name="__main__")
