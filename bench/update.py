"""Update-phase levers, A/B in one run: the optimizer implementation (fused AdamW vs foreach), when
replicas all-reduce gradients (once per mini-batch vs after every micro-batch), how (FSDP2's
native HSDP all-reduce, block by block inside backward, vs distflow's bucketed reducer that
overlaps the buckets with the rest of backward), and how micro-batches are cut (padded rows vs
packed rows that compute each group's prompt once, `optim.shared_prefix`).

Each configuration runs under `torchrun --standalone --nproc_per_node N` with the model recipe's
FSDP layout (the built-in models replicate: `model.shard_ranks=1`). Every rank builds the FSDP2
policy and a fixed batch of groups (G samples sharing one random prompt), then times one
optimizer step (`Updater.backward_policy` over the rank's micro-batches + `Policy.step`), slowest
rank, cycling through the (variant, shared-prefix mode) pairs so machine noise hits all alike:

    baseline   foreach AdamW, native all-reduce after every micro-batch (distflow at first)
    fused      fused AdamW,   native all-reduce after every micro-batch
    fsdp       fused AdamW,   native all-reduce once per mini-batch (model.replica_grad_sync=fsdp)
    default    fused AdamW,   bucketed all-reduce once per mini-batch, overlapped (distflow now)

The first three share one policy, `default` has its own (same weights): the all-reduce path is
fixed when a policy is sharded. With one process there is no all-reduce: fsdp = default.

Host memory is set up as in a training run: the trainer's `run.host_mmap_threshold_kib` and
huge pages for large tensors (distflow.run.hostmem); both decide how often fresh pages fault
in. Each update's minor page faults and system time (rank max) are reported beside its time.

`--shape` picks the batch (per rank): `arith` (default; the lever comparison: 8 samples of one
prompt each, prompts 40-48 tokens, responses 16-32, micro-batches of 2), or a grouped shape for
`--shared-prefix off,on` (then the default): `demo` (SmolLM2's demo: 2 prompts x G=4, prompts
~57 tokens, responses ~34, one micro-batch of 8), `tools` (2 x 4, prompts ~400, responses ~100)
and `long` (1 x 4, prompt 512, responses 2048, micro-batches of 2; memory only). Lengths are drawn
(seeded) around the centres; `--group-size`, `--prompt-len`, `--response-len`, `--seqs` and
`--micro-batch-size` override the shape's.

    .venv/bin/python bench/update.py                          # tiny + smollm2_135m, 1 and 2 processes
    .venv/bin/python bench/update.py --models smollm2_135m --nprocs 2 --iters 6
    .venv/bin/python bench/update.py --shape demo --nprocs 1,2           # padded vs packed, SmolLM2
    .venv/bin/python bench/update.py --shape long                        # peak memory, padded vs packed
    .venv/bin/python bench/update.py --smoke --results-dir /tmp/r
    .venv/bin/python bench/update.py --models smollm2_135m --nprocs 2 --profile 25   # + where the time goes

`--memory` measures the peak memory of one update's forward + backward passes per shared-prefix
mode (bench/update_memory.py's measurement: RSS high-water mark on CPU, peak allocated on CUDA),
each mode in a fresh process (`--smoke`: inside the timing launch, before the timed updates);
`--iters 0` skips the timing.

`--profile N` also runs one more `default` update under torch.profiler after the timed ones and
prints rank 0's N ops with the most self CPU time, then its N costliest (op, input shapes,
caller) triples, the caller being the nearest distflow, FSDP, autograd, checkpoint or optimizer
frame: that tells FSDP2's gradient copies from its parameter casts. A copy goes to the work dir
as `<model>-n<N>-profile.txt`; the profiled update is not among the timed ones.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("baseline", "fused", "fsdp", "default")
MODES = ("off", "on")  # optim.shared_prefix

# name: group size, (prompt centre, +-), (response centre, +-), samples per rank, micro-batch size
SHAPES = {
    "arith": (1, (44, 4), (24, 8), 8, 2),
    "demo": (4, (57, 6), (34, 14), 8, 8),
    "tools": (4, (400, 40), (100, 50), 8, 8),
    "long": (4, (512, 0), (2048, 0), 4, 2),
}


def batch_samples(a, vocab: int, g) -> list:
    """`a.seqs` samples in groups of `a.group_size` that share one random prompt; each length
    drawn uniformly within its shape's spread (scaled when the centre is overridden)."""
    import torch

    from distflow.sample import Sample

    def draw(centre: int, spread: int) -> int:
        return max(1, centre + int(torch.randint(-spread, spread + 1, (), generator=g)))

    samples, prompt = [], []
    for i in range(a.seqs):
        if i % a.group_size == 0:
            prompt = torch.randint(3, vocab, (draw(a.prompt_len, a.prompt_spread),), generator=g).tolist()
        response = torch.randint(3, vocab, (draw(a.response_len, a.response_spread),), generator=g).tolist()
        samples.append(Sample(list(prompt), response, [0.0] * len(response), False))
    return samples


def worker(a) -> None:
    import common as C
    import torch

    from distflow.config import DistflowConfig
    from distflow.distributed import all_reduce, barrier, init_distributed, shutdown
    from distflow.run.hostmem import limit_malloc_retention
    from distflow.distributed.layout import ParallelLayout
    from distflow.models.tiny import resolve_model_path
    from distflow.train.batch import UpdateBatch
    from distflow.train.policy import Policy
    from distflow.train.update import Updater

    variants, modes = a.variants.split(","), a.shared_prefix.split(",")
    cfg = DistflowConfig()
    cfg.model.shard_ranks = C.recipe_shard_ranks(a.model)
    cfg.model.dtype = a.dtype
    cfg.algorithm.group_size = a.group_size
    cfg.optim.micro_batch_size, cfg.optim.lr = a.micro_batch_size, 1e-6
    # one policy serves both modes: installed, its padded passes run the model's own attention
    cfg.optim.shared_prefix = "on" if "on" in modes else "off"
    info = init_distributed("gloo", "cpu")
    if not a.memory:  # the trainer's host-memory setting; --memory keeps the launch's (exact RSS)
        limit_malloc_retention(cfg.run.host_mmap_threshold_kib)
    policies = {}
    for sync, needed in (("fsdp", any(v != "default" for v in variants)),
                         ("bucketed", "default" in variants or a.memory)):
        if needed:
            cfg.model.replica_grad_sync = sync
            policies[sync] = Policy(resolve_model_path(a.model), cfg.model, cfg.optim,
                                    ParallelLayout.from_config(cfg.model, info))
    policy = next(iter(policies.values()))
    g = torch.Generator().manual_seed(1000 + info.rank)
    samples = batch_samples(a, policy.model.config.vocab_size, g)
    adv = torch.randn(len(samples), generator=g)
    batch = UpdateBatch.from_samples(samples, 0, info.device)
    batch = batch.with_(advantages=adv[:, None] * batch.tokens.resp_mask)
    rows = list(range(len(batch)))
    updaters = {}
    for mode in modes:
        cfg.optim.shared_prefix = mode
        updaters[mode] = Updater(cfg, 0)

    memory = {}
    if a.memory:  # first, on the freshly built policy: no gradients or optimizer state yet
        from update_memory import micro_batch_peak

        for mode in modes:
            cfg.optim.shared_prefix = mode
            m = micro_batch_peak(policies["bucketed"], batch, cfg)
            memory[mode] = {k: float(all_reduce(v, "max")) for k, v in m.items()}

    tokens = {}
    for mode in modes:  # what each mode feeds the model, filler passes of short ranks included
        micro = updaters[mode].micro_batches(batch.tokens, rows)
        real = sum(int(mb.inputs.attention_mask.sum()) for mb in micro)
        padded = sum(mb.inputs.input_ids.numel() for mb in micro)
        tokens[mode] = dict(zip(("fed_tokens", "padded_tokens", "passes"),
                                all_reduce([real, padded, len(micro)], "max").long().tolist()))

    params = list(policy.model.parameters())
    optimizers = {}
    if "fsdp" in policies:
        optimizers["fused"] = policies["fsdp"].optimizer
        if "baseline" in variants:
            optimizers["foreach"] = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                                      foreach=True)
        sync = policies["fsdp"].all_reduce_gradients  # (enabled): whether the next backward all-reduces
    plan_s: dict[str, list[float]] = {m: [] for m in modes}

    def one_update(variant: str, mode: str) -> tuple[float, float, float]:
        model = policies["bucketed" if variant == "default" else "fsdp"]
        if variant != "default":
            model.optimizer = optimizers["foreach" if variant == "baseline" else "fused"]
            model.all_reduce_gradients = sync if variant == "fsdp" else (lambda enabled: sync(True))
        barrier()
        t = time.perf_counter()
        micro = updaters[mode].micro_batches(batch.tokens, rows)  # the trainer plans once per batch
        plan_s[mode].append(float(all_reduce(time.perf_counter() - t, "max")))
        barrier()
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        sums = updaters[mode].backward_policy(model, batch, rows, micro)
        t1 = time.perf_counter()
        model.step(sums.loss)
        t2, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        # page faults and kernel time: what fresh memory costs (distflow.run.hostmem)
        took = [t1 - t0, t2 - t1, t2 - t0, ru1.ru_minflt - ru0.ru_minflt, ru1.ru_stime - ru0.ru_stime]
        return tuple(all_reduce(took, "max").tolist())

    pairs = [(v, m) for m in modes for v in variants]
    keys = ("backward_s", "optimizer_s", "update_s", "minor_faults", "system_s")
    times = {m: {v: {k: [] for k in keys} for v in variants} for m in modes}
    for v, m in pairs if a.iters and not a.no_warmup else ():  # warm-up: optimizer state, allocator
        one_update(v, m)
    for i in range(a.iters):
        for v, m in pairs if i % 2 == 0 else pairs[::-1]:
            for key, t in zip(keys, one_update(v, m)):
                times[m][v][key].append(t)
    if a.profile and a.iters:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
            one_update("default" if "default" in variants else variants[0], modes[0])
        if info.rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile)
            table += "\n" + by_caller(prof.events(), a.profile)
            with open(a.out.removesuffix(".json") + "-profile.txt", "w") as f:
                f.write(table)
    sample_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    all_tokens = int(all_reduce(sample_tokens))
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"times": times, "plan_s": plan_s, "tokens": tokens, "memory": memory,
                       "world_size": info.world_size, "seqs_per_rank": len(samples),
                       "tokens_per_rank": sample_tokens, "tokens_all_ranks": all_tokens,
                       "micro_batch_size": a.micro_batch_size, "torch_threads": torch.get_num_threads(),
                       "shard_ranks": cfg.model.shard_ranks, "params": sum(p.numel() for p in params)}, f)
    barrier()
    shutdown()


def comma_list(value: str, allowed, flag: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {','.join(bad) or 'empty'} not in {','.join(allowed)}")
    return items


def summarize(r: dict, modes: list[str], variants: list[str]) -> dict:
    """Per shared-prefix mode: medians, spread, tokens/s (the samples' tokens of all ranks, as the
    trainer's throughput/update_tokens_per_s), what the mode fed the model, plan time, memory."""
    out = {}
    for mode in modes:
        times = r["times"][mode]
        timed = [v for v in variants if times[v]["update_s"]]
        med = {v: {k: statistics.median(ts) for k, ts in times[v].items()} for v in timed}
        out[mode] = {**r["tokens"][mode], "median_s": med,
                     "spread_update_s": {v: [min(times[v]["update_s"]), max(times[v]["update_s"])] for v in timed},
                     "tokens_per_s": {v: r["tokens_all_ranks"] / med[v]["update_s"] for v in timed},
                     "plan_s_median": statistics.median(r["plan_s"][mode]) if r["plan_s"][mode] else None}
        if mode in r["memory"]:
            out[mode]["memory"] = r["memory"][mode]
    return out


# Frames that say who asked for an op (the first of them, walking out from the op); the
# torch.nn.modules frames in between (a Linear's forward, ...) say nothing here.
CALLERS = ("distflow/", "fsdp/", "autograd", "torch/utils/checkpoint", "torch/optim", "torch/nn/utils")


def by_caller(events, rows: int) -> str:
    """Self CPU time per (op, input shapes, nearest calling frame): which code a `copy_` or `mm`
    comes from, not only how long all of them took together."""
    totals: dict[tuple[str, str, str], list] = {}
    for e in events:
        if e.device_type.name != "CPU" or not e.name.startswith("aten::"):
            continue
        caller, q = "?", e.cpu_parent
        while q is not None:
            if any(c in q.name for c in CALLERS) and "nn/modules" not in q.name:
                caller = q.name.split("site-packages/")[-1].split("src/")[-1]
                break
            q = q.cpu_parent
        t = totals.setdefault((e.name, str(e.input_shapes[:2]), caller), [0.0, 0])
        t[0] += e.self_cpu_time_total / 1e3
        t[1] += 1
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:rows]
    return "self ms  calls  op [input shapes]  <- nearest caller\n" + "\n".join(
        f"{ms:7.1f} {n:6d}  {op} {shapes}  <- {caller}" for (op, shapes, caller), (ms, n) in top)


def main() -> None:
    import common as C
    from update_memory import MALLOC_ENV

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list (default 1,2; --smoke: 2; --shape long: 1)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed updates per variant (default 5; --smoke: 1; --shape long: 0, memory only)")
    p.add_argument("--shape", default="arith", choices=list(SHAPES), help="the batch per rank (see the docstring)")
    p.add_argument("--seqs", type=int, default=None, help="sequences per rank (default: the shape's)")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt (default: the shape's)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens, centre (default: the shape's)")
    p.add_argument("--response-len", type=int, default=None, help="response tokens, centre (default: the shape's)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per forward/backward (default: the shape's)")
    p.add_argument("--shared-prefix", default=None,
                   help="comma list of optim.shared_prefix modes, off,on (default: off for arith, off,on otherwise)")
    p.add_argument("--variants", default=None,
                   help=f"comma list of {','.join(VARIANTS)} (default: all for arith, default otherwise)")
    p.add_argument("--memory", action="store_true", help="peak memory of one update per mode (--shape long: on)")
    p.add_argument("--profile", type=int, default=0, help="print the top N ops of one profiled update")
    p.add_argument("--dtypes", default="float32", help="comma list of model.dtype values, one run each")
    args = p.parse_args()
    group, (prompt, prompt_spread), (response, response_spread), seqs, mbs = SHAPES[args.shape]
    grouped = args.shape != "arith"
    group, seqs, mbs = args.group_size or group, args.seqs or seqs, args.micro_batch_size or mbs
    if args.prompt_len:
        prompt, prompt_spread = args.prompt_len, round(prompt_spread * args.prompt_len / prompt)
    if args.response_len:
        response, response_spread = args.response_len, round(response_spread * args.response_len / response)
    modes = comma_list(args.shared_prefix or ("off,on" if grouped else "off"), MODES, "--shared-prefix")
    variants = comma_list(args.variants or ("default" if grouped else ",".join(VARIANTS)), VARIANTS, "--variants")
    memory = args.memory or args.shape == "long"
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    default_nprocs = "2" if args.smoke else "1" if args.shape == "long" else "1,2"
    nprocs = [int(n) for n in (args.nprocs or default_nprocs).split(",")]
    iters = args.iters if args.iters is not None else 1 if args.smoke else 0 if args.shape == "long" else 5
    if iters <= 0 and not memory:
        raise SystemExit("--iters 0 measures nothing without --memory")
    models = C.models(args) if args.models or args.smoke or not grouped else ["smollm2_135m"]
    shape = {"name": args.shape, "group_size": group, "prompt_len": prompt, "prompt_spread": prompt_spread,
             "response_len": response, "response_spread": response_spread, "seqs": seqs, "micro_batch_size": mbs}
    wd = C.work_dir(args, "update")
    records, rows, sp_rows, mem_rows = [], [], [], []
    for model in models:
        for nproc, dtype in ((n, d) for n in nprocs for d in dtypes):
            tag = f"{model}-n{nproc}-{dtype}"

            def launch(name: str, mode_list: list[str], n_iters: int, measure: bool, var: list[str]) -> dict:
                out = wd / f"{name}.json"
                C.fresh(out)
                print(f"[update] {model} nproc={nproc} dtype={dtype} shape={args.shape} "
                      f"shared_prefix={','.join(mode_list)}{' memory' if measure else ''}", flush=True)
                C.torchrun(__file__, ["--worker", "--model", model, "--iters", str(n_iters), "--seqs", str(seqs),
                                      "--group-size", str(group), "--prompt-len", str(prompt),
                                      "--prompt-spread", str(prompt_spread), "--response-len", str(response),
                                      "--response-spread", str(response_spread), "--micro-batch-size", str(mbs),
                                      "--profile", str(args.profile), "--dtype", dtype, "--out", str(out),
                                      "--shared-prefix", ",".join(mode_list), "--variants", ",".join(var),
                                      *(["--memory"] if measure else []), *(["--no-warmup"] if args.smoke else [])],
                           nproc, wd / f"{name}.log", extra_env=MALLOC_ENV if measure else None)
                return json.loads(out.read_text())

            if memory and not args.smoke:  # each mode in a fresh process, so no peak carries over
                mem = {m: launch(f"{tag}-memory-{m}", [m], 0, True, ["default"])["memory"][m] for m in modes}
                r = launch(tag, modes, iters, False, variants) if iters else None
            else:
                r = launch(tag, modes, iters, memory, variants)
                mem = r["memory"]
            if args.profile and iters:
                print(Path(str(wd / tag) + "-profile.txt").read_text(), flush=True)
            rec = {"model": model, "processes": nproc, "dtype": dtype, "shape": shape, "iters": iters,
                   "shared_prefix": modes, "variants": variants, "memory": mem}
            if r is not None:
                by_mode = summarize(r, modes, variants)
                med = by_mode[modes[0]]["median_s"]
                rec.update({"params": r["params"], "shard_ranks": r["shard_ranks"], "seqs_per_rank": r["seqs_per_rank"],
                            "micro_batch_size": r["micro_batch_size"], "tokens_per_rank": r["tokens_per_rank"],
                            "median_s": med, "by_shared_prefix": by_mode, "raw": r})
                for name, num, den in (("speedup_fused", "baseline", "fused"),
                                       ("speedup_default", "baseline", "default"),
                                       ("speedup_bucketed", "fsdp", "default")):
                    if num in med and den in med:
                        rec[name] = med[num]["update_s"] / med[den]["update_s"]
                if len(modes) == 2:  # off / on update time and on / off tokens fed, per variant
                    off, on = by_mode["off"], by_mode["on"]
                    rec["speedup_shared_prefix"] = {v: off["median_s"][v]["update_s"] / on["median_s"][v]["update_s"]
                                                    for v in variants}
                    rec["fed_tokens_on_over_off"] = on["fed_tokens"] / off["fed_tokens"]
                for mode in modes:
                    m = by_mode[mode]
                    for v in variants:
                        t = m["median_s"][v]
                        base = med.get("baseline", {}).get("update_s")
                        rows.append([model, nproc, dtype, mode, v, t["backward_s"], t["optimizer_s"], t["update_s"],
                                     base / t["update_s"] if base else "-", round(t["minor_faults"] / 1e3),
                                     t["system_s"]])
                        first = by_mode[modes[0]]
                        sp_rows.append([model, nproc, dtype, v, mode, m["passes"], m["fed_tokens"], m["padded_tokens"],
                                        f"{m['fed_tokens'] / first['fed_tokens']:.2f}", t["update_s"],
                                        "{:.3g}-{:.3g}".format(*m["spread_update_s"][v]), m["tokens_per_s"][v],
                                        f"{first['median_s'][v]['update_s'] / t['update_s']:.2f}"])
            for mode, m in mem.items():
                mem_rows.append([model, nproc, dtype, mode, m["before_mib"], m["peak_mib"], m["delta_mib"],
                                 f"{m['delta_mib'] / mem[modes[0]]['delta_mib']:.2f}", m["seconds"]])
            records.append(rec)
    if rows:
        print(C.table(["model", "procs", "dtype", "shared_prefix", "variant", "backward s", "optimizer s", "update s",
                       "speedup", "faults k", "system s"], rows))
    if sp_rows and (len(modes) > 1 or grouped):
        print(f"\nshape {args.shape}: G={group}, prompts ~{prompt}, responses ~{response}, {seqs} samples and "
              f"micro-batches of {mbs} per rank; tokens per rank (busiest), vs and speedup: against {modes[0]}")
        print(C.table(["model", "procs", "dtype", "variant", "shared_prefix", "passes", "fed tokens", "incl. padding",
                       "vs", "update s", "min-max", "tokens/s", "speedup"], sp_rows))
    if mem_rows:
        print("\npeak memory of one update's forward + backward passes (MiB; max over ranks)")
        print(C.table(["model", "procs", "dtype", "shared_prefix", "before", "peak", "delta", "delta vs", "seconds"],
                      mem_rows))
    # a grouped shape's comparison is its own file: update.json stays the lever comparison
    name = "update" if args.shape == "arith" else f"update_{args.shape}"
    C.write_json(args.results_dir, name, {"bench": "update", "smoke": args.smoke, "machine": C.machine(),
                                          "variants": variants, "shared_prefix": modes, "shape": shape,
                                          "records": records})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--dtype", default="float32")
        for flag in ("--model", "--out", "--shared-prefix", "--variants"):
            ap.add_argument(flag, required=True)
        for flag in ("--iters", "--seqs", "--group-size", "--prompt-len", "--prompt-spread", "--response-len",
                     "--response-spread", "--micro-batch-size", "--profile"):
            ap.add_argument(flag, type=int, required=True)
        for flag in ("--worker", "--memory", "--no-warmup"):
            ap.add_argument(flag, action="store_true")
        worker(ap.parse_args())
        from distflow.run.exit import exit_process

        exit_process(0)  # the measured ranks are done: skip the interpreter's teardown of torch and vLLM
    else:
        main()
