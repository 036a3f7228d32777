"""Start-up memory: peak host RSS per rank while the FSDP2 policy, KL reference and PPO critic are
built, with meta-device start-up (model.meta_device_init=true: rank 0 reads the weights, the
others only allocate their shards) and without (every rank reads the whole model first).

Each configuration is one fresh `torchrun --standalone` launch (`--smoke`: one launch builds both
settings of model.meta_device_init, one after the other). Before each model a rank resets
its peak (/proc/self/clear_refs, 5) and reads VmHWM afterwards, so `peak` is that model's own
high-water mark, on top of what the rank already held (`before`, which includes torch and
transformers themselves). On CUDA the peak allocated device memory is recorded as well.

    .venv/bin/python bench/startup.py                                # smollm2_135m, 2 ranks, both layouts
    .venv/bin/python bench/startup.py --models tiny --nprocs 1,2
    .venv/bin/python bench/startup.py --smoke --results-dir /tmp/r     # tiny, plain FSDP only, one launch

`measure(model, nproc, meta, shard_ranks, work_dir)` is the one-configuration entry point other
benchmarks call; it returns the per-rank record (`measure_launch`: several settings of `meta` in
turn in one launch, a record each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STAGES = ("policy", "reference", "critic")  # the trainer's order


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def worker(a) -> None:
    import torch.distributed as dist

    from distflow.distributed import init_distributed, shutdown

    info = init_distributed("gloo", "auto")
    results = [build(a, meta, info) for meta in a.meta]
    if info.rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    shutdown()


def build(a, meta: bool, info) -> dict:
    """Policy, reference and critic with model.meta_device_init=`meta`: each rank's memory per stage."""
    import gc

    import torch
    import torch.distributed as dist

    from distflow.config import DistflowConfig
    from distflow.distributed.devices import resolve_auto
    from distflow.distributed.layout import ParallelLayout
    from distflow.models.tiny import resolve_model_path
    from distflow.train.critic import Critic
    from distflow.train.policy import Policy

    cfg = DistflowConfig()
    cfg.model.path = a.model
    cfg = resolve_auto(cfg, info.device)
    cfg.model.meta_device_init = meta
    cfg.model.shard_ranks = a.shard_ranks
    cfg.algorithm.advantage = "gae"  # the critic follows from the estimator
    path = resolve_model_path(a.model)
    layout = ParallelLayout.from_config(cfg.model, info)
    _ = layout.fsdp_mesh  # process-group set-up is not model start-up
    cuda = info.device.type == "cuda"
    built, stages = [], {}
    for stage in STAGES:
        torch.manual_seed(0)
        dist.barrier()
        _reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before, t0 = _status_mib("VmRSS"), time.perf_counter()
        if stage == "critic":
            built.append(Critic(path, cfg.critic, cfg.model, cfg.optim, layout))
        else:
            built.append(Policy(path, cfg.model, cfg.optim, layout, trainable=stage == "policy"))
        seconds = time.perf_counter() - t0
        stages[stage] = {"before_mib": before, "peak_mib": _status_mib("VmHWM"), "after_mib": _status_mib("VmRSS"),
                         "seconds": seconds}
        if cuda:
            stages[stage]["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, stages)
    dist.barrier()
    del built
    gc.collect()
    return {"ranks": ranks, "world_size": info.world_size, "shard": layout.shard, "device": info.device.type}


def measure(model: str, nproc: int, meta: bool, shard_ranks: int, work_dir: Path) -> dict:
    """One launch: per-rank start-up memory of policy, reference and critic (see the module doc)."""
    return measure_launch(model, nproc, [meta], shard_ranks, work_dir)[0]


def measure_launch(model: str, nproc: int, metas: list[bool], shard_ranks: int, work_dir: Path) -> list[dict]:
    """One launch that measures each model.meta_device_init of `metas` in turn; a record each."""
    import common as C

    name = f"{model}-n{nproc}-shard{shard_ranks}-" + "-".join("meta" if m else "full" for m in metas)
    out = Path(work_dir) / f"{name}.json"
    C.fresh(out)
    C.torchrun(__file__, ["--worker", "--model", model, "--out", str(out), "--shard-ranks", str(shard_ranks),
                          "--meta", ",".join(str(m).lower() for m in metas)], nproc, Path(work_dir) / f"{name}.log")
    return [{"model": model, "processes": nproc, "shard_ranks": shard_ranks, "meta_device_init": m, **r}
            for m, r in zip(metas, json.loads(out.read_text()))]


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list (default 2; --smoke: 2)")
    p.add_argument("--layouts", default=None,
                   help="comma list of model.shard_ranks, -1 = plain FSDP (default -1,1; --smoke: -1)")
    args = p.parse_args()
    if not args.models:
        args.models = "tiny" if args.smoke else "smollm2_135m"
    nprocs = [int(n) for n in (args.nprocs or "2").split(",")]
    layouts = [int(s) for s in (args.layouts or ("-1" if args.smoke else "-1,1")).split(",")]
    wd = C.work_dir(args, "startup")
    records, rows = [], []
    for model in C.models(args):
        for nproc in nprocs:
            for shard in layouts:
                # side by side, in one run; a fresh launch each (--smoke: both in one)
                for metas in ([[False, True]] if args.smoke else [[False], [True]]):
                    print(f"[startup] {model} nproc={nproc} shard_ranks={shard} meta={','.join(map(str, metas))}",
                          flush=True)
                    for rec in measure_launch(model, nproc, metas, shard, wd):
                        records.append(rec)
                        meta = rec["meta_device_init"]
                        for rank, stages in enumerate(rec["ranks"]):
                            peak = max(s["peak_mib"] for s in stages.values())
                            rows.append([model, nproc, shard, meta, rank, stages["policy"]["before_mib"], peak,
                                         *(stages[s]["peak_mib"] - stages[s]["before_mib"] for s in STAGES),
                                         stages["critic"]["after_mib"], sum(s["seconds"] for s in stages.values())])
    print(C.table(["model", "procs", "shard", "meta", "rank", "before MiB", "peak MiB", "policy +MiB", "ref +MiB",
                   "critic +MiB", "after MiB", "build s"], rows))
    C.write_json(args.results_dir, "startup", {"bench": "startup", "smoke": args.smoke, "machine": C.machine(),
                                               "records": records})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--model", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--shard-ranks", type=int, required=True)
        ap.add_argument("--meta", type=lambda v: [x == "true" for x in v.split(",")], default=[False],
                        help="comma list of model.meta_device_init values, measured one after the other")
        ap.add_argument("--worker", action="store_true")
        worker(ap.parse_args())
        from distflow.run.exit import exit_process

        exit_process(0)  # the measured ranks are done: skip the interpreter's teardown of torch and vLLM
    else:
        main()
