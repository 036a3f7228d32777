"""recipes/grpo.py with this machine's matmul FLOP/s, fp32 and bf16, measured inside the same run
(bench/flops.py).

An observer of the run (distflow.metrics.timer) measures after the models are loaded (the process group exists) and again after
the last step, every rank runs the same matmuls at the same time, with the thread count the run
uses (see measure(): the machine's aggregate rate for this process layout), in every dtype of
$DISTFLOW_FLOPS_DTYPES: square ones ($DISTFLOW_FLOPS_SIZES) and the model's own forward GEMMs
($DISTFLOW_FLOPS_GEMMS, from bench/flops.py). Rank 0 writes the numbers to $DISTFLOW_FLOPS_OUT.
The recipe itself runs unchanged.
"""

from __future__ import annotations

import json
import os
import time

import common
import torch
import torch.nn.functional as F

# per rank per timed round: long enough to time, short enough for 4096^3 alone ($DISTFLOW_FLOPS_ROUND:
# bench/flops.py --smoke asks for less, only to check that the measurement runs)
ROUND_FLOPS = float(os.environ.get("DISTFLOW_FLOPS_ROUND", "1e10"))


def rate(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    """Aggregate FLOP/s of `F.linear([m, k], [n, k])` (the kernel nn.Linear runs) on all ranks at
    once: each timed round starts with a barrier, every rank does the same number of products, and
    the round lasts as long as the slowest rank (so no rank is timed while another one idles).
    Best of `reps` rounds after one warm-up round."""
    from distflow.distributed import all_reduce, barrier

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    flops = 2 * m * k * n
    inner = max(1, min(64, round(ROUND_FLOPS / flops)))
    best = float("inf")
    for _ in range(reps + 1):
        barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            F.linear(x, w)
        best = min(best, float(all_reduce(time.perf_counter() - t0, "max")))
    return world * inner * flops / best


def measure_dtype(dtype: str, sizes: list[int], gemms: dict, reps: int) -> dict:
    """Square n x n x n rates, the model's GEMM rates and their mix (FLOP-weighted by how often one
    forward runs each shape: the best the model's matmuls do here), and the peak over all of them."""
    dt = getattr(torch, dtype)
    square = {str(n): rate(n, n, n, dt, reps) for n in sizes}
    by_gemm = {key: rate(g["m"], g["k"], g["n"], dt, reps) for key, g in gemms.items()}
    mix = None
    if gemms:
        work = {key: g["count"] * 2 * g["m"] * g["k"] * g["n"] for key, g in gemms.items()}
        mix = sum(work.values()) / sum(work[key] / by_gemm[key] for key in gemms)
    shape, peak = max({**{f"{n}x{n}x{n}": v for n, v in square.items()}, **by_gemm}.items(), key=lambda kv: kv[1])
    return {"square": square, "gemms": by_gemm, "gemm_mix": mix, "peak": peak, "peak_shape": shape}


def measure(dtypes: list[str], sizes: list[int], gemms: dict, reps: int) -> dict:
    res = {dt: measure_dtype(dt, sizes, gemms, reps) for dt in dtypes}
    return {**res, "threads_per_rank": torch.get_num_threads()}


def install() -> None:
    import distflow.metrics.timer

    env = os.environ.get
    dtypes = env("DISTFLOW_FLOPS_DTYPES", "float32,bfloat16").split(",")
    sizes = [int(s) for s in env("DISTFLOW_FLOPS_SIZES", "1024,2048,4096").split(",") if s]
    gemms = json.loads(env("DISTFLOW_FLOPS_GEMMS", "{}"))
    reps = int(env("DISTFLOW_FLOPS_REPS", "5"))
    class Measure:
        """An observer of the run (distflow.metrics.timer): matmuls before the first step and after the last."""

        def on_train_start(self, step: int) -> None:
            self.before = measure(dtypes, sizes, gemms, reps)

        def on_run_end(self, trainer) -> None:
            after = measure(dtypes, sizes, gemms, reps)
            if trainer.dist.is_main and env("DISTFLOW_FLOPS_OUT"):
                with open(env("DISTFLOW_FLOPS_OUT"), "w") as f:
                    json.dump({"before": self.before, "after": after, "world_size": trainer.dist.world_size,
                               "gemms": gemms}, f, indent=1)

    distflow.metrics.timer.PROCESS_OBSERVERS.append(Measure())


if __name__ == "__main__":
    install()
    common.run_grpo_recipe()
