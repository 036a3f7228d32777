"""Update-phase levers, A/B in one run: the optimizer implementation (fused AdamW vs foreach), when
replicas all-reduce gradients (once per mini-batch vs after every micro-batch) and how (FSDP2's
native HSDP all-reduce, block by block inside backward, vs distflow's bucketed reducer that
overlaps the buckets with the rest of backward).

Each configuration runs under `torchrun --standalone --nproc_per_node N` with the model recipe's
FSDP layout (the built-in models replicate: `model.shard_ranks=1`). Every rank builds the FSDP2
policy and a fixed batch of arithmetic-sized sequences, then times one optimizer step
(`update.backward_policy_loss` over the rank's micro-batches + `Policy.step`), slowest rank,
cycling through the variants so machine noise hits all of them alike:

    baseline   foreach AdamW, native all-reduce after every micro-batch (distflow at first)
    fused      fused AdamW,   native all-reduce after every micro-batch
    fsdp       fused AdamW,   native all-reduce once per mini-batch (model.replica_grad_sync=fsdp)
    default    fused AdamW,   bucketed all-reduce once per mini-batch, overlapped (distflow now)

The first three share one policy, `default` has its own (same weights): the all-reduce path is
fixed when a policy is sharded. With one process there is no all-reduce: fsdp = default.

    .venv/bin/python bench/update.py                          # tiny + smollm2_135m, 1 and 2 processes
    .venv/bin/python bench/update.py --models smollm2_135m --nprocs 2 --iters 6
    .venv/bin/python bench/update.py --smoke --results-dir /tmp/r
    .venv/bin/python bench/update.py --models smollm2_135m --nprocs 2 --profile 25   # + where the time goes

`--profile N` also runs one more `default` update under torch.profiler after the timed ones and
prints rank 0's N ops with the most self CPU time (a copy goes to the work dir as
`<model>-n<N>-profile.txt`); the profiled update is not among the timed ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("baseline", "fused", "fsdp", "default")


def worker(a) -> None:
    import common as C
    import torch

    from distflow.config import DistflowConfig
    from distflow.distributed import all_reduce, barrier, init_distributed, shutdown
    from distflow.distributed.layout import ParallelLayout
    from distflow.models.tiny import resolve_model_path
    from distflow.sample import Sample
    from distflow.train.batch import UpdateBatch
    from distflow.train.policy import Policy
    from distflow.train.update import Updater

    cfg = DistflowConfig()
    cfg.model.shard_ranks = C.recipe_shard_ranks(a.model)
    cfg.model.dtype = a.dtype
    cfg.optim.micro_batch_size, cfg.optim.lr = a.micro_batch_size, 1e-6
    info = init_distributed("gloo", "cpu")
    policies = {}
    for sync in ("fsdp", "bucketed"):
        cfg.model.replica_grad_sync = sync
        policies[sync] = Policy(resolve_model_path(a.model), cfg.model, cfg.optim,
                                ParallelLayout.from_config(cfg.model, info))
    policy = policies["fsdp"]
    vocab = policy.model.config.vocab_size
    g = torch.Generator().manual_seed(1000 + info.rank)
    samples = []
    for i in range(a.seqs):  # prompt ~ a chat-templated arithmetic question, response up to 32 tokens
        p_len, r_len = 40 + i % 9, 16 + (7 * i) % 17
        ids = torch.randint(3, vocab, (p_len + r_len,), generator=g).tolist()
        samples.append(Sample(ids[:p_len], ids[p_len:], [0.0] * r_len, False))
    adv = torch.randn(len(samples), generator=g)
    batch = UpdateBatch.from_samples(samples, 0, info.device)
    batch = batch.with_(advantages=adv[:, None] * batch.tokens.resp_mask)
    rows = list(range(len(batch)))

    params = list(policy.model.parameters())
    optimizers = {"fused": policy.optimizer,
                  "foreach": torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, foreach=True)}
    sync = policy.all_reduce_gradients  # (enabled): whether the next backward all-reduces

    def one_update(variant: str) -> float:
        model = policies["bucketed" if variant == "default" else "fsdp"]
        if variant != "default":
            model.optimizer = optimizers["foreach" if variant == "baseline" else "fused"]
            model.all_reduce_gradients = sync if variant == "fsdp" else (lambda enabled: sync(True))
        barrier()
        t0 = time.perf_counter()
        sums = Updater(cfg, 0).backward_policy(model, batch, rows)
        t1 = time.perf_counter()
        model.step(sums.loss)
        t2 = time.perf_counter()
        return float(all_reduce(t1 - t0, "max")), float(all_reduce(t2 - t1, "max")), float(all_reduce(t2 - t0, "max"))

    times = {v: {"backward_s": [], "optimizer_s": [], "update_s": []} for v in VARIANTS}
    for v in VARIANTS:  # warm-up: optimizer state, allocator
        one_update(v)
    for i in range(a.iters):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        for v in order:
            for key, t in zip(("backward_s", "optimizer_s", "update_s"), one_update(v)):
                times[v][key].append(t)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_update("default")
        if info.rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile)
            with open(a.out.removesuffix(".json") + "-profile.txt", "w") as f:
                f.write(table)
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"times": times, "world_size": info.world_size, "seqs_per_rank": len(samples),
                       "tokens_per_rank": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
                       "micro_batch_size": a.micro_batch_size, "torch_threads": torch.get_num_threads(),
                       "shard_ranks": cfg.model.shard_ranks, "params": sum(p.numel() for p in params)}, f)
    barrier()
    shutdown()


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list (default 1,2; --smoke: 2)")
    p.add_argument("--iters", type=int, default=None, help="timed updates per variant (default 5; --smoke: 1)")
    p.add_argument("--seqs", type=int, default=8, help="sequences per rank")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per forward/backward")
    p.add_argument("--profile", type=int, default=0, help="print the top N ops of one profiled update")
    p.add_argument("--dtypes", default="float32", help="comma list of model.dtype values, one run each")
    args = p.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    nprocs = [int(n) for n in (args.nprocs or ("2" if args.smoke else "1,2")).split(",")]
    iters = args.iters or (1 if args.smoke else 5)
    wd = C.work_dir(args, "update")
    records, rows = [], []
    for model in C.models(args):
        for nproc, dtype in ((n, d) for n in nprocs for d in dtypes):
            out = wd / f"{model}-n{nproc}-{dtype}.json"
            C.fresh(out)
            print(f"[update] {model} nproc={nproc} dtype={dtype}", flush=True)
            C.torchrun(__file__, ["--worker", "--model", model, "--iters", str(iters), "--seqs", str(args.seqs),
                                  "--micro-batch-size", str(args.micro_batch_size), "--profile", str(args.profile),
                                  "--dtype", dtype, "--out", str(out)],
                       nproc, wd / f"{model}-n{nproc}-{dtype}.log")
            if args.profile:
                print(Path(str(out).removesuffix(".json") + "-profile.txt").read_text(), flush=True)
            r = json.loads(out.read_text())
            med = {v: {k: statistics.median(ts) for k, ts in r["times"][v].items()} for v in VARIANTS}
            rec = {"model": model, "processes": nproc, "dtype": dtype, "params": r["params"], "shard_ranks": r["shard_ranks"],
                   "seqs_per_rank": r["seqs_per_rank"], "micro_batch_size": r["micro_batch_size"],
                   "tokens_per_rank": r["tokens_per_rank"], "iters": iters, "median_s": med,
                   "speedup_fused": med["baseline"]["update_s"] / med["fused"]["update_s"],
                   "speedup_default": med["baseline"]["update_s"] / med["default"]["update_s"],
                   "speedup_bucketed": med["fsdp"]["update_s"] / med["default"]["update_s"], "raw": r}
            records.append(rec)
            for v in VARIANTS:
                rows.append([model, nproc, dtype, v, med[v]["backward_s"], med[v]["optimizer_s"], med[v]["update_s"],
                             med["baseline"]["update_s"] / med[v]["update_s"]])
    print(C.table(["model", "procs", "dtype", "variant", "backward s", "optimizer s", "update s", "speedup"], rows))
    C.write_json(args.results_dir, "update", {"bench": "update", "smoke": args.smoke, "machine": C.machine(),
                                              "variants": VARIANTS, "records": records})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--dtype", default="float32")
        for flag in ("--model", "--out"):
            ap.add_argument(flag, required=True)
        for flag, default in (("--iters", 3), ("--seqs", 8), ("--micro-batch-size", 2), ("--profile", 0)):
            ap.add_argument(flag, type=int, default=default)
        ap.add_argument("--worker", action="store_true")
        worker(ap.parse_args())
    else:
        main()
