"""Communication volume: bytes each rank sends per training step outside FSDP's own traffic, for
world sizes 1, 2, 4 (and 8 when memory allows; oversubscribed, only bytes are counted), on the
smoke experiment (recipes/experiment/smoke.yaml: tiny model, 2 prompts x 4 samples per rank).

Runs `torchrun --standalone --nproc_per_node N bench/comm_entry.py experiment=smoke ...`, which
installs bench/comm_hooks.py (counting wrappers around torch.distributed's collectives and the
functional collectives) and then runs recipes/grpo.py unchanged. Reported per rank per step
(the maximum over ranks of the median over steps):

  distflow_bytes   torch.distributed collectives called from distflow's own code (its all_reduce /
                   broadcast_object / barrier helpers); 0 at world size 1, where they return early
  helper_bytes     the payload handed to those helpers, counted even at world size 1
  fsdp_sync_bytes  FSDP2's all-gathers/reduce-scatters + DTensor gathers of the weight sync
                   (and clip_grad_norm_'s scalar reduce), reported separately

  vllm_other_bytes vLLM's own collectives (a tensor-parallel engine's all-reduces) and the rest

With `--tp 1,2` each world size also runs with rollout.tensor_parallel_size=2 (sizes it divides):
the ranks of an engine group all-gather their requests before each engine call (distflow's code,
so counted in distflow_bytes), and what a rank sends must stay flat in the world size there too.

With `--roles` the world sizes run role-split (pipeline.mode=split, W/2 trainers + W/2 rollout ranks,
world sizes 2 and 4 by default): what each role's rank sends per step, its weight broadcasts and
messages (distflow's code) over the run divided by its steps. A trainer sends its rollout set (one
rank here) the model once per version and a control; a rollout rank sends its groups, one message
per trainer: both must stay flat in W.

    .venv/bin/python bench/comm.py                 # world sizes 1,2,4 (+8 if memory allows), k = 1, 2
    .venv/bin/python bench/comm.py --world-sizes 1,2,4,8 --tp 1
    .venv/bin/python bench/comm.py --smoke --results-dir /tmp/r   # world sizes 1 and 2, launched at once
    .venv/bin/python bench/comm.py --roles --world-sizes 2,4      # split runs: bytes per role
"""

from __future__ import annotations

import json
import statistics

import common as C

TOLERANCE = 0.10
GIB_PER_RANK = 2.5  # rough peak per rank of the smoke experiment (vLLM engine with 1 GiB KV cache + FSDP)


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def per_step(rank: dict, steps: list[int], pick) -> float:
    return statistics.median(pick(rank["phases"].get(f"step {s}", {"collectives": {}, "helpers": {}})) for s in steps)


def distflow_bytes(p):
    return sum(b for _, b in p["collectives"].get("distflow", {}).values())


def distflow_calls(p):
    return sum(c for c, _ in p["collectives"].get("distflow", {}).values())


def helper_bytes(p):
    return sum(b for _, b in p["helpers"].values())


def helper_calls(p):
    return sum(c for c, _ in p["helpers"].values())


def fsdp_sync_bytes(p):
    return sum(b for cat in ("fsdp", "dtensor") for _, b in p["collectives"].get(cat, {}).values())


def other_bytes(p):
    return sum(b for cat in ("vllm", "other") for _, b in p["collectives"].get(cat, {}).values())


def flat(values: list[float]) -> bool:
    ref = values[0]
    return ref > 0 and all(abs(v / ref - 1) <= TOLERANCE for v in values)


def counted_run(args, wd, tag: str, w: int, model: str, steps: int, extra: list[str]) -> list[dict]:
    """One smoke run on `w` ranks under bench/comm_entry.py (`extra`: more overrides); each rank's counts."""
    out, run_dir = wd / tag, wd / f"run-{tag}"
    C.fresh(out, run_dir)
    overrides = ["experiment=smoke", f"model={model}", f"rollout={C.engine(args)}", f"run.steps={steps}",
                 f"run.output_dir={run_dir}", "checkpoint.resume=never", "logging.plot_at_end=false",
                 "logging.progress_bar=false", *extra]
    C.torchrun(C.BENCH / "comm_entry.py", overrides, w, wd / f"{tag}.log", extra_env={"DISTFLOW_COMM_OUT": str(out)})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(w)]


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default=None, help="comma list (default 1,2,4 plus 8 if memory allows; --smoke: 1,2)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 3; --smoke: 1)")
    p.add_argument("--tp", default=None, help="comma list of rollout.tensor_parallel_size (default 1,2; --smoke: 1)")
    p.add_argument("--roles", action="store_true", help="role-split runs (W/2 + W/2): bytes per role's rank per step")
    args = p.parse_args()
    if args.roles:
        return roles(args)
    tps = [int(k) for k in (args.tp or ("1" if args.smoke else "1,2")).split(",")]
    if args.world_sizes:
        sizes = [int(w) for w in args.world_sizes.split(",")]
    elif args.smoke:
        sizes = [1, 2]
    else:
        sizes = [1, 2, 4]
        if mem_available_gib() >= 8 * GIB_PER_RANK:
            sizes.append(8)
        else:
            print(f"[comm] skipping world size 8: {mem_available_gib():.1f} GiB available < {8 * GIB_PER_RANK} GiB")
    steps = args.steps or (1 if args.smoke else 3)
    wd = C.work_dir(args, "comm")
    results = {}
    model = C.models(args)[0]  # the smoke experiment's model (tiny); bytes do not depend on the model

    def measure(w: int, k: int) -> dict:
        print(f"[comm] world size {w}, tensor_parallel_size {k}", flush=True)
        ranks = counted_run(args, wd, f"{model}-w{w}" + (f"-tp{k}" if k > 1 else ""), w, model, steps,
                            [f"rollout.tensor_parallel_size={k}"])
        step_ids = list(range(1, ranks[0]["steps"] + 1))
        rec = {"world_size": w, "tensor_parallel_size": k, "steps": len(step_ids)}
        for key, fn in (("distflow_bytes", distflow_bytes), ("distflow_calls", distflow_calls),
                        ("helper_bytes", helper_bytes), ("helper_calls", helper_calls),
                        ("fsdp_sync_bytes", fsdp_sync_bytes), ("vllm_other_bytes", other_bytes)):
            rec[f"{key}_per_rank_per_step"] = max(per_step(r, step_ids, fn) for r in ranks)
        rec["rank0_phases"] = ranks[0]["phases"]
        return rec

    for k in tps:
        # bytes, not times: --smoke launches the world sizes at once
        records = C.each(lambda w: measure(w, k), [w for w in sizes if w % k == 0], together=args.smoke)
        rows = [[r["world_size"], k, r["distflow_bytes_per_rank_per_step"], r["distflow_calls_per_rank_per_step"],
                 r["helper_bytes_per_rank_per_step"], r["fsdp_sync_bytes_per_rank_per_step"],
                 r["vllm_other_bytes_per_rank_per_step"]] for r in records]
        print(C.table(["world", "k", "distflow B/rank/step", "calls/step", "helper payload B", "fsdp+sync B",
                       "vllm+other B"], rows))
        multi = [r["distflow_bytes_per_rank_per_step"] for r in records if r["world_size"] > 1]
        helper = [r["helper_bytes_per_rank_per_step"] for r in records]
        results[k] = {
            "bytes_per_rank_per_step": {str(r["world_size"]): r["distflow_bytes_per_rank_per_step"] for r in records},
            "helper_payload_bytes_per_rank_per_step": {str(r["world_size"]): r["helper_bytes_per_rank_per_step"]
                                                       for r in records},
            "fsdp_sync_bytes_per_rank_per_step": {str(r["world_size"]): r["fsdp_sync_bytes_per_rank_per_step"]
                                                  for r in records},
            "vllm_other_bytes_per_rank_per_step": {str(r["world_size"]): r["vllm_other_bytes_per_rank_per_step"]
                                                   for r in records},
            # flat: the helpers' payload is within +-10% of world size 1's at every size, and the
            # bytes actually sent (0 at world size 1, where nothing is sent) are within +-10% across sizes > 1
            "flat": flat(helper) and (not multi or flat(multi)),
            "records": records,
        }
    # k = 1 at the top level (as before); other k under "tensor_parallel", keyed by k
    top = results.get(1, {})
    others = {str(k): r for k, r in results.items() if k != 1}
    C.write_json(args.results_dir, "comm", {"bench": "comm", "smoke": args.smoke, "machine": C.machine(),
                                            "experiment": "smoke", "model": model, "tolerance": TOLERANCE,
                                            "world_sizes": sizes, **top, "tensor_parallel": others})


def roles(args) -> None:
    """Split runs at each world size: the largest bytes per step any trainer and any rollout rank sends."""
    sizes = [int(w) for w in (args.world_sizes or "2,4").split(",")]
    steps, wd, model = args.steps or 3, C.work_dir(args, "comm_roles"), C.models(args)[0]
    records = []
    for w in sizes:
        print(f"[comm] world size {w}: {w // 2} trainers + {w // 2} rollout ranks", flush=True)
        ranks = counted_run(args, wd, f"w{w}", w, model, steps, ["pipeline=split", f"pipeline.rollout_ranks={w // 2}"])
        sent = [sum(distflow_bytes(p) for p in r["phases"].values()) / steps for r in ranks]
        records.append({"world_size": w, "trainers": w // 2, "steps": steps,
                        "trainer_bytes_per_step": max(sent[: w // 2]), "rollout_bytes_per_step": max(sent[w // 2:]),
                        "per_rank_bytes_per_step": sent})
    print(C.table(["world", "trainers", "trainer B/step", "rollout rank B/step"],
                  [[r["world_size"], r["trainers"], r["trainer_bytes_per_step"], r["rollout_bytes_per_step"]]
                   for r in records]))
    flat_roles = {key: flat([r[key] for r in records]) for key in ("trainer_bytes_per_step", "rollout_bytes_per_step")}
    C.write_json(args.results_dir, "comm_roles", {"bench": "comm_roles", "smoke": args.smoke, "machine": C.machine(),
                                                  "experiment": "smoke", "model": model, "tolerance": TOLERANCE,
                                                  "world_sizes": sizes, "records": records, "flat": flat_roles})


if __name__ == "__main__":
    main()
