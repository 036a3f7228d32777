"""Weight resync cost: distflow's FSDP2 -> engine resync (Trainer.sync_weights: full_parameters()
streamed into engine.load_weights) for the real vLLM engine on CPU and the HF engine, vs a plain
torch copy of a flat fp32 buffer of the same size on this machine. ratio = resync / copy (medians).

Each configuration runs under `torchrun --standalone --nproc_per_node N` with the same start-up
order as the trainer (process group, engine, FSDP2 policy); `--smoke` builds the engines of one
process count in one launch and times them one after the other, then (on the same vLLM engine,
built with LoRA on) the LoRA resyncs below, saving start-ups. Also reported: `gather_s`, the time to
just materialise the stream (DTensor.full_tensor + dtype cast) without loading it into an engine.

With `--tp 1,2` the 2-process vLLM runs also use one tensor-parallel engine over both ranks
(rollout.tensor_parallel_size=2): every rank still streams the full tensors, and vLLM's loader
keeps each worker's half. Configurations run one after the other, so compare them side by side.

With `--lora-ranks 8,16` the vLLM runs also train LoRA policies of those ranks (adapters given
random values, so they matter) and time both of their resyncs in the same process, on one engine
with vLLM's LoRA support on: `adapter` (model.lora.resync=adapter: only the adapters, written to a
RAM folder and loaded by vLLM) and `merged` (base + adapters through full_parameters, served
without an adapter). Each also reports the bytes it sends, the post-resync probe (max |engine -
policy| logprob) and generation tokens/s with and without the adapter (vLLM computes it per token).

    .venv/bin/python bench/sync.py                       # tiny + smollm2_135m, vllm + hf, 1 and 2 processes
    .venv/bin/python bench/sync.py --models tiny --engines vllm --nprocs 2 --tp 1,2
    .venv/bin/python bench/sync.py --models smollm2_135m --nprocs 1 --iters 20
    .venv/bin/python bench/sync.py --models smollm2_135m --engines vllm --nprocs 1 --lora-ranks 8,16
    .venv/bin/python bench/sync.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

GOAL = 1.5


def worker(a) -> None:
    """Full-weight resyncs into each engine of --engine (one after the other, on one policy), then,
    with --lora-rank, both LoRA resyncs on the vLLM engine (built with LoRA on) and a LoRA policy."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from distflow.config import DistflowConfig, LoraConfig
    from distflow.distributed import all_reduce, barrier, init_distributed, shutdown
    from distflow.distributed.devices import resolve_auto
    from distflow.distributed.layout import ParallelLayout
    from distflow.models.tiny import resolve_model_path
    from distflow.rollout import build_engine
    from distflow.train.weight_stream import full_parameters
    from distflow.train.policy import Policy

    names = [n for n in a.engine.split(",") if n]  # full-weight resyncs, one engine after the other
    built = names + (["vllm"] if a.lora_rank and "vllm" not in names else [])
    cfg = DistflowConfig()
    cfg.model.path, cfg.rollout.tensor_parallel_size = a.model, a.tp
    cfg.model.dtype = a.dtype
    cfg.rollout.max_new_tokens, cfg.rollout.max_prompt_tokens = 32, 128
    info = init_distributed("gloo", "cpu")
    cfg = resolve_auto(cfg, info.device)  # the trainer's dtype and shard degree for this model
    lora_model = dataclasses.replace(cfg.model, lora=LoraConfig(enabled=True, rank=a.lora_rank, alpha=2.0 * a.lora_rank,
                                                                resync="adapter")) if a.lora_rank else None
    path = resolve_model_path(a.model)
    layout = ParallelLayout.from_config(cfg.model, info, a.tp)
    # trainer's order: engine, then policy
    engines = {}
    for name in built:
        cfg.rollout.engine = name
        engines[name] = build_engine(path, lora_model if name == "vllm" and lora_model else cfg.model, cfg.rollout,
                                     info.device, 0, layout.engine_group)
    dtype, bucket = getattr(torch, cfg.model.dtype), cfg.rollout.sync_bucket_mib << 20

    def timed(fn) -> list[float]:
        out = []
        for i in range(a.iters + 1):  # first call is a warm-up
            barrier()
            t0 = time.perf_counter()
            fn()
            dt = float(all_reduce(time.perf_counter() - t0, "max"))  # slowest rank, like timing/sync_s
            if i:
                out.append(dt)
        return out

    result = {}
    if names:
        policy = Policy(path, cfg.model, cfg.optim, layout)
        sync_s = {name: timed(lambda: engines[name].load_weights(full_parameters(policy.model, dtype, bucket)))
                  for name in names}
        gather_s = timed(lambda: [None for _ in full_parameters(policy.model, dtype, bucket)])
        numel = sum(p.numel() for p in policy.model.parameters())  # unique (a tied head once), full sizes
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        src, dst = torch.randn(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        copy_s = timed(lambda: dst.copy_(src))
        result["resync"] = {name: {"sync_s": sync_s[name], "gather_s": gather_s, "copy_s": copy_s, "numel": numel,
                                   "bytes": nbytes, "world_size": info.world_size, "tensor_parallel_size": a.tp,
                                   "torch_threads": torch.get_num_threads(),
                                   "bucket_mib": cfg.rollout.sync_bucket_mib}
                            for name in names}
        del policy
    if lora_model:
        policy = Policy(path, lora_model, cfg.optim, layout)
        result["lora"] = lora_worker(a, info, engines["vllm"], policy, dtype, bucket, timed)
        del policy
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        barrier()
    for e in engines.values():
        e.shutdown()
    shutdown()


def lora_worker(a, info, engine, policy, dtype, bucket, timed) -> dict:
    """Both LoRA resyncs on one engine: the adapter first (the engine still holds the base it
    loaded, or the same base as the full-weight resyncs before it), then merged weights served
    without the adapter."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from distflow.probe import max_logprob_diff
    from distflow.train.weight_stream import full_parameters
    from distflow.train.lora import adapter_tensors

    with torch.no_grad():  # adapters that change the model (B = 0 would make both modes trivial)
        g = torch.Generator().manual_seed(0)
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                value = torch.randn(p.shape, generator=g) * 0.02
                p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value)
    prompts = [torch.randint(10, 400, (48,), generator=g).tolist() for _ in range(8)]  # ids every model has
    probe_seqs = [p + p[:16] for p in prompts[:2]]

    def generate_tps() -> float:
        t0 = time.perf_counter()
        groups = engine.generate(prompts, 1, list(range(len(prompts))))
        return sum(len(s.response_ids) for grp in groups for s in grp) / (time.perf_counter() - t0)

    out = {"world_size": info.world_size, "lora_rank": a.lora_rank, "dtype": str(dtype).removeprefix("torch."),
           "modes": {}}
    adapters = adapter_tensors(policy.model)
    sync_s = timed(lambda: engine.load_adapter(adapter_tensors(policy.model), policy.adapter_config))
    out["modes"]["adapter"] = {"sync_s": sync_s, "bytes": sum(t.numel() * t.element_size() for t in adapters.values()),
                               "probe": max_logprob_diff(engine, policy, probe_seqs, 0),
                               "generate_tokens_per_s": [generate_tps() for _ in range(a.gen_rounds)]}
    engine.lora_request = None  # from here on the engine serves what load_weights gives it
    sync_s = timed(lambda: engine.load_weights(full_parameters(policy.model, dtype, bucket)))
    numel = sum(t.numel() for _, t in full_parameters(policy.model, dtype, bucket))
    out["modes"]["merged"] = {"sync_s": sync_s, "bytes": numel * torch.empty((), dtype=dtype).element_size(),
                              "probe": max_logprob_diff(engine, policy, probe_seqs, 0),
                              "generate_tokens_per_s": [generate_tps() for _ in range(a.gen_rounds)]}
    return out


def lora_records(model: str, nproc: int, r: dict) -> tuple[list[dict], list[list]]:
    records, rows = [], []
    for mode, m in r["modes"].items():
        rec = {"model": model, "engine": "vllm", "processes": nproc, "lora_rank": r["lora_rank"], "dtype": r["dtype"],
               "resync": mode,
               "bytes": m["bytes"], "sync_s_median": statistics.median(m["sync_s"]), "probe_max_abs_diff": m["probe"],
               "generate_tokens_per_s_median": statistics.median(m["generate_tokens_per_s"]), "raw": m}
        records.append(rec)
        rows.append([model, nproc, r["lora_rank"], mode, m["bytes"] / 2**20, rec["sync_s_median"] * 1e3,
                     f"{m['probe']:.2g}", rec["generate_tokens_per_s_median"]])
    return records, rows


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--nprocs", default=None, help="comma list (default 1,2; --smoke: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed resyncs per configuration (default 10; --smoke: 1)")
    p.add_argument("--tp", default="1", help="comma list of rollout.tensor_parallel_size for vLLM (those dividing nproc)")
    p.add_argument("--dtype", default="auto", help="model.dtype of the engine and the policy (auto: as the trainer)")
    p.add_argument("--lora-ranks", default=None, help="comma list of LoRA ranks for the vLLM runs (default none; --smoke: 8)")
    args = p.parse_args()
    lora_ranks = [int(r) for r in (args.lora_ranks or ("8" if args.smoke else "")).split(",") if r]
    tps = [int(k) for k in args.tp.split(",")]
    nprocs = [int(n) for n in (args.nprocs or ("1" if args.smoke else "1,2")).split(",")]
    iters = args.iters or (1 if args.smoke else 10)
    wd = C.work_dir(args, "sync")
    # One launch per configuration: the full-weight resyncs of every model, then the LoRA ones.
    # --smoke joins the engines of one (nproc, k) in one launch and adds its LoRA rank to it.
    launches = []
    for model in C.models(args):
        for e, n, k in [(e, n, k) for e in args.engines.split(",") for n in nprocs
                        for k in (tps if e == "vllm" else [1]) if n % k == 0]:
            host = next((x for x in launches if args.smoke and (x["model"], x["nproc"], x["k"]) == (model, n, k)), None)
            if host:
                host["engines"].append(e)
            else:
                launches.append({"model": model, "nproc": n, "k": k, "engines": [e], "lora": 0})
    for model in C.models(args) if "vllm" in args.engines.split(",") else []:
        for n, rank in [(n, r) for n in nprocs for r in lora_ranks]:
            host = next((x for x in launches if args.smoke and not x["lora"]
                         and (x["model"], x["nproc"], x["k"]) == (model, n, 1)), None)
            if host:
                host["lora"] = rank
            else:
                launches.append({"model": model, "nproc": n, "k": 1, "engines": [], "lora": rank})
    records, rows, lora, lora_rows = [], [], [], []
    for launch in launches:
        model, nproc, k, names, rank = (launch[x] for x in ("model", "nproc", "k", "engines", "lora"))
        tag = "-".join([model, *names, *([f"lora{rank}"] if rank else []), f"n{nproc}", *([f"tp{k}"] if k > 1 else [])])
        out = wd / f"{tag}.json"
        C.fresh(out)
        print(f"[sync] {model} engine={','.join(names) or 'vllm'} nproc={nproc} tensor_parallel_size={k}"
              + (f", LoRA rank {rank}: adapter and merged resyncs" if rank else ""), flush=True)
        C.torchrun(__file__, ["--worker", "--model", model, "--engine", ",".join(names), "--iters", str(iters),
                              "--tp", str(k), "--lora-rank", str(rank), "--gen-rounds", "1" if args.smoke else "3",
                              "--dtype", args.dtype, "--out", str(out)], nproc, wd / f"{tag}.log")
        results = json.loads(out.read_text())
        for engine in names:
            r = results["resync"][engine]
            sync, gather, copy = (statistics.median(r[x]) for x in ("sync_s", "gather_s", "copy_s"))
            ratios = [s / copy for s in r["sync_s"]]
            rec = {"model": model, "engine": engine, "processes": nproc, "tensor_parallel_size": k,
                   "bytes": r["bytes"],
                   "sync_s_median": sync, "gather_s_median": gather, "copy_s_median": copy,
                   "ratio_median": sync / copy, "ratio_min": min(ratios), "ratio_max": max(ratios),
                   "copy_gb_per_s": r["bytes"] / copy / 1e9, "iters": iters, "raw": r}
            records.append(rec)
            rows.append([model, engine, nproc, k, r["bytes"] / 2**20, sync * 1e3, gather * 1e3, copy * 1e3,
                         rec["ratio_median"], GOAL])
        if rank:
            recs, more = lora_records(model, nproc, results["lora"])
            lora += recs
            lora_rows += more
    print(C.table(["model", "engine", "procs", "k", "MiB", "resync ms", "gather ms", "copy ms", "ratio", "goal"], rows))
    if lora_rows:
        print(C.table(["model", "procs", "lora rank", "resync", "MiB", "resync ms", "probe", "gen tok/s"], lora_rows))
    # Headline: the vLLM engine (the default) on the largest model measured, 1 process (no all-gather).
    head = [r for r in records if r["engine"] == "vllm" and r["processes"] == min(nprocs)
            and r["tensor_parallel_size"] == 1] or records
    head = max(head, key=lambda r: r["bytes"])
    C.write_json(args.results_dir, "sync", {
        "bench": "sync", "smoke": args.smoke, "machine": C.machine(), "goal_ratio": GOAL,
        "ratio_median": head["ratio_median"],
        "headline": {k: head[k] for k in ("model", "engine", "processes")},
        "meets_goal": head["ratio_median"] <= GOAL, "records": records, "lora_records": lora})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        for flag in ("--model", "--engine", "--out"):
            ap.add_argument(flag, required=True)
        ap.add_argument("--iters", type=int, default=5)
        ap.add_argument("--tp", type=int, default=1)
        ap.add_argument("--lora-rank", type=int, default=0)
        ap.add_argument("--gen-rounds", type=int, default=3, help="timed generations after each LoRA resync")
        ap.add_argument("--dtype", default="auto")
        ap.add_argument("--worker", action="store_true")
        worker(ap.parse_args())
        from distflow.run.exit import exit_process

        exit_process(0)  # the measured ranks are done: skip the interpreter's teardown of torch and vLLM
    else:
        main()
