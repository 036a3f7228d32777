"""Training-phase efficiency: achieved FLOP/s of distflow's update phase vs this machine's fp32
matmul FLOP/s measured in the same run.

    train FLOP/s = 6 x params x trained tokens / update time

params: the model's unique parameters (a tied head once); trained tokens: prompt+response tokens
of all ranks in the step (padding excluded); update time: timing/update_s (slowest rank) from
metrics.jsonl, step 1 (warm-up) skipped. The peak is the best aggregate fp32 matmul FLOP/s of
square matrices (1024, 2048), all ranks multiplying at once inside the same torchrun job, right
after the models are loaded and again after the last step (bench/flops_entry.py); the higher is used.

    .venv/bin/python bench/flops.py                       # tiny + smollm2_135m, 1 and 2 processes
    .venv/bin/python bench/flops.py --models smollm2_135m --nprocs 1 --steps 5
    .venv/bin/python bench/flops.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import json

import common as C
from vs_trl import SETTINGS

GOAL = 0.50


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list (default 1,2; --smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="measured steps after 1 warm-up (default 3; --smoke: 1)")
    args = p.parse_args()
    nprocs = [int(n) for n in (args.nprocs or ("1" if args.smoke else "1,2")).split(",")]
    measured = args.steps or (1 if args.smoke else 3)
    wd = C.work_dir(args, "flops")
    env = {"DISTFLOW_FLOPS_SIZES": "256,512" if args.smoke else "1024,2048",
           "DISTFLOW_FLOPS_REPS": "2" if args.smoke else "5"}
    records, rows = [], []
    for model in C.models(args):
        s = dict(SETTINGS[model])
        if args.smoke:
            s.update(prompts_per_step=2, group_size=2, max_new_tokens=8)
        params = C.count_params(C.resolve_model(model))
        for nproc in nprocs:
            out = wd / f"run-{model}-n{nproc}"
            peak_file = wd / f"peak-{model}-n{nproc}.json"
            C.fresh(out, peak_file)
            print(f"[flops] {model} nproc={nproc}", flush=True)
            overrides = C.distflow_overrides(model, out, measured + 1, max(1, s["prompts_per_step"] // nproc),
                                             s["group_size"], s["max_new_tokens"], s["lr"], C.engine(args))
            C.torchrun(C.BENCH / "flops_entry.py", overrides, nproc, wd / f"{model}-n{nproc}.log",
                       extra_env={**env, "DISTFLOW_FLOPS_OUT": str(peak_file)})
            peak_rec = json.loads(peak_file.read_text())
            peak = max(peak_rec["before"]["peak"], peak_rec["after"]["peak"])
            ms = C.read_metrics(out)
            assert len(ms) == measured + 1, f"{out}: {len(ms)} logged steps, expected {measured + 1}"
            ms = ms[1:]  # step 1 is the warm-up
            tokens = sum(C.step_tokens(m) for m in ms)
            update_s = sum(m["timing/update_s"] for m in ms)
            flops = 6 * params * tokens / update_s
            per_step = [6 * params * C.step_tokens(m) / m["timing/update_s"] for m in ms]
            rec = {"model": model, "processes": nproc, "params": params,
                   "trained_tokens_per_step": tokens / len(ms), "update_s_per_step": update_s / len(ms),
                   "train_flops_per_s": flops, "matmul_peak_flops_per_s": peak,
                   "train_flops_fraction_of_peak": flops / peak,
                   "per_step_fraction": [f / peak for f in per_step],
                   "peak_measurements": peak_rec, "measured_steps": len(ms),
                   "timing_s_per_step": {k[7:-2]: sum(m[k] for m in ms) / len(ms) for k in ms[0]
                                         if k.startswith("timing/")},
                   "config": {**s, "command": f"torchrun --standalone --nproc_per_node {nproc} bench/flops_entry.py "
                              + " ".join(overrides)}}
            records.append(rec)
            rows.append([model, nproc, params / 1e6, rec["trained_tokens_per_step"], rec["update_s_per_step"],
                         flops / 1e9, peak / 1e9, 100 * flops / peak])
    print(C.table(["model", "procs", "Mparams", "tokens/step", "update s", "train GFLOP/s", "peak GFLOP/s", "% peak"],
                  rows))
    # Headline: the largest model measured, 1 process (or the fewest measured).
    head = max((r for r in records if r["processes"] == min(nprocs)), key=lambda r: r["params"])
    C.write_json(args.results_dir, "flops", {
        "bench": "flops", "smoke": args.smoke, "machine": C.machine(), "goal_fraction": GOAL,
        "train_flops_fraction_of_peak": head["train_flops_fraction_of_peak"],
        "headline": {k: head[k] for k in ("model", "processes")},
        "meets_goal": head["train_flops_fraction_of_peak"] >= GOAL, "records": records})


if __name__ == "__main__":
    main()
