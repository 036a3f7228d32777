"""End-to-end GRPO throughput: distflow (recipes/grpo.py, vLLM engine) vs TRL's GRPOTrainer
(transformers generate), on the same model, prompts, group size, prompts per step, completion
length, learning rate, beta = 0 and process count. Both are launched with
`torchrun --standalone --nproc_per_node N` (gloo, OMP_NUM_THREADS = cores / N each; --smoke, whose
two launches run at once: cores / 2N); runs alternate (distflow first on even repeats, TRL first on
odd ones). Step 1 of each run is a warm-up and is skipped; tokens/s = prompt+completion tokens of
all ranks / summed step time. --dtype bfloat16 trains both in bf16 over fp32 master weights:
distflow with model.dtype=bfloat16 (FSDP2's compute dtype and the engine's), TRL with
GRPOConfig(bf16=True) (autocast).

    .venv/bin/python bench/vs_trl.py                      # tiny + smollm2_135m (if available), 1 and 2 processes
    .venv/bin/python bench/vs_trl.py --models tiny --repeats 5
    .venv/bin/python bench/vs_trl.py --models smollm2_135m --dtype bfloat16
    .venv/bin/python bench/vs_trl.py --smoke --results-dir /tmp/r   # 1 process each, both launched at once
"""

from __future__ import annotations

import json
import statistics

import common as C

# Per model: global prompts per step, group size, max completion tokens, learning rate, and the
# default repeats / measured steps (SmolLM2 steps take minutes on 2 shared CPU cores).
SETTINGS = {
    "tiny": dict(prompts_per_step=8, group_size=4, max_new_tokens=32, lr=1e-5),
    "smollm2_135m": dict(prompts_per_step=2, group_size=4, max_new_tokens=32, lr=1e-6),
}
DEFAULT_RUNS = {"tiny": dict(repeats=3, steps=4), "smollm2_135m": dict(repeats=2, steps=2)}
GOALS = {"tiny": 1.5, "smollm2_135m": 2.5}
KEYS = ("model", "processes", "dtype")  # what a record measured; vs_trl.json keeps one record per value


def run_distflow(model: str, nproc: int, steps: int, s: dict, wd, tag: str, engine: str, dtype: str) -> dict:
    out = wd / f"distflow-{tag}"
    C.fresh(out)
    overrides = C.distflow_overrides(model, out, steps, s["prompts_per_step"] // nproc, s["group_size"],
                                     s["max_new_tokens"], s["lr"], engine, extra=[f"model.dtype={dtype}"])
    wall = C.torchrun(C.GRPO, overrides, nproc, wd / f"distflow-{tag}.log")
    ms = C.read_metrics(out)
    assert len(ms) == steps, f"{out}: {len(ms)} logged steps, expected {steps}"
    ms = ms[1:]  # step 1 is the warm-up
    secs, toks = [m["timing/step_s"] for m in ms], [C.step_tokens(m) for m in ms]
    resolved = json.loads((out / "config.json").read_text())["model"]["dtype"]
    assert resolved == dtype, f"{out}: model.dtype resolved to {resolved}, asked for {dtype}"
    return {"step_s": secs, "tokens": toks, "tokens_per_s": sum(toks) / sum(secs), "launch_wall_s": wall,
            "command": f"torchrun --standalone --nproc_per_node {nproc} recipes/grpo.py " + " ".join(overrides)}


def run_trl(model_path: str, nproc: int, steps: int, s: dict, wd, tag: str, dtype: str, smoke: bool = False) -> dict:
    out = wd / f"trl-{tag}.json"
    C.fresh(out, wd / f"trl-{tag}")
    args = ["--model-path", model_path, "--data", str(C.ARITH), "--system-prompt", C.SYSTEM_PROMPT,
            "--num-generations", str(s["group_size"]), "--prompts-per-step", str(s["prompts_per_step"]),
            "--max-completion-length", str(s["max_new_tokens"]), "--lr", str(s["lr"]), "--steps", str(steps),
            "--output-dir", str(wd / f"trl-{tag}"), "--out", str(out), *(["--bf16"] if dtype == "bfloat16" else []),
            *(["--hide-vllm", "--skip-teardown"] if smoke else [])]
    wall = C.torchrun(C.BENCH / "trl_grpo.py", args, nproc, wd / f"trl-{tag}.log")
    rec = json.loads(out.read_text())
    ms = rec["steps"][1:]
    secs, toks = [m["step_s"] for m in ms], [m["tokens"] for m in ms]
    return {"step_s": secs, "tokens": toks, "tokens_per_s": sum(toks) / sum(secs), "launch_wall_s": wall,
            "trl_config": rec["config"],
            "trl_precision": {k: rec[k] for k in ("param_dtype", "mixed_precision", "autocast")},
            "command": f"torchrun --standalone --nproc_per_node {nproc} bench/trl_grpo.py "
            + " ".join(f"'{a}'" if " " in a else a for a in args)}


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list of process counts (default 1,2; --smoke: 1)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 for tiny, 2 for smollm2 (--smoke: 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps per run, after 1 warm-up (default 4 for tiny, 2 for smollm2; --smoke: 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="training dtype of both: distflow model.dtype, TRL bf16 autocast (default float32)")
    args = p.parse_args()
    models = C.models(args)
    nprocs = [int(n) for n in (args.nprocs or ("1" if args.smoke else "1,2")).split(",")]
    wd = C.work_dir(args, "vs_trl")

    # records stored before --dtype existed were all float32
    previous = [{"dtype": "float32", **r} for r in C.previous_records(args.results_dir, "vs_trl", args.smoke)]
    records, rows = [], []
    for model in models:
        s = dict(SETTINGS[model])
        if args.smoke:
            s.update(prompts_per_step=2, group_size=2, max_new_tokens=8)
        repeats = args.repeats or (1 if args.smoke else DEFAULT_RUNS[model]["repeats"])
        measured = args.steps or (1 if args.smoke else DEFAULT_RUNS[model]["steps"])
        path = C.resolve_model(model)
        for nproc in nprocs:
            reps = []
            for r in range(repeats):
                tag = f"{model}-n{nproc}-{args.dtype}-r{r}"
                order = ["distflow", "trl"] if r % 2 == 0 else ["trl", "distflow"]

                def one(who: str) -> dict:
                    print(f"[vs_trl] {model} nproc={nproc} {args.dtype} repeat {r + 1}/{repeats}: {who}", flush=True)
                    load = C.loadavg()
                    out = (run_distflow(model, nproc, measured + 1, s, wd, tag, C.engine(args), args.dtype)
                           if who == "distflow" else
                           run_trl(path, nproc, measured + 1, s, wd, tag, args.dtype, args.smoke))
                    return {**out, "loadavg_1m": [load, C.loadavg()]}  # machine load (others' jobs) before / after

                # --smoke launches both at once: it checks that they run, not how fast
                res = dict(zip(order, C.each(one, order, together=args.smoke)))
                res["ratio"] = res["distflow"]["tokens_per_s"] / res["trl"]["tokens_per_s"]
                res["order"] = order
                reps.append(res)
            ratios = [x["ratio"] for x in reps]
            d_tps = statistics.median(x["distflow"]["tokens_per_s"] for x in reps)
            t_tps = statistics.median(x["trl"]["tokens_per_s"] for x in reps)
            d_step = statistics.median(v for x in reps for v in x["distflow"]["step_s"])
            t_step = statistics.median(v for x in reps for v in x["trl"]["step_s"])
            rec = {
                "model": model, "processes": nproc, "dtype": args.dtype,
                "distflow_tokens_per_s": d_tps, "trl_tokens_per_s": t_tps,
                "distflow_step_s_median": d_step, "trl_step_s_median": t_step,
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "goal_ratio": GOALS[model], "meets_goal": statistics.median(ratios) >= GOALS[model],
                "repeats": repeats, "measured_steps": measured, "warmup_steps": 1,
                "config": {**s, "global_sequences_per_step": s["prompts_per_step"] * s["group_size"],
                           "omp_num_threads_per_process": max(1, C.CORES // (nproc * (2 if args.smoke else 1))),
                           "beta": 0.0,
                           "distflow_command": reps[0]["distflow"]["command"], "trl_command": reps[0]["trl"]["command"],
                           "trl_grpo_config": reps[0]["trl"]["trl_config"],
                           "trl_precision": reps[0]["trl"]["trl_precision"]},
                "runs": [{"order": x["order"], "ratio": x["ratio"],
                          **{f"{w}_{k}": x[w][k] for w in ("distflow", "trl")
                             for k in ("tokens_per_s", "step_s", "tokens", "launch_wall_s", "loadavg_1m")}} for x in reps],
            }
            records.append(rec)
            rows.append([model, nproc, args.dtype, d_step, t_step, d_tps, t_tps, rec["ratio_min"], rec["ratio_median"],
                         rec["ratio_max"], GOALS[model]])
            # written after every configuration, so a long run that fails later keeps what it measured;
            # records of other (model, processes, dtype) triples already in the file are kept
            C.write_json(args.results_dir, "vs_trl", {"bench": "vs_trl", "smoke": args.smoke, "machine": C.machine(),
                                                      "records": C.merge_records(previous, records, KEYS)})
    print(C.table(["model", "procs", "dtype", "df step_s", "trl step_s", "df tok/s", "trl tok/s", "ratio min",
                   "ratio med", "ratio max", "goal"], rows))


if __name__ == "__main__":
    main()
