"""Cross-rank length balancing: the slowest vs the fastest rank's update time, balancing off vs on,
on a task whose prompt lengths are skewed across ranks.

The task (written to the work folder) alternates long prompts (a ~3x preamble) and short ones;
with `data.shuffle=false` the global stream gives every long prompt to rank 0 of 2, the worst
case the balancer exists for. Runs of `recipes/grpo.py` with `run.balance_lengths=false` and
`=true` alternate (off first on even repeats); step 1 of each run is a warm-up and is skipped.
Per step the trainer logs the slowest rank's update time (`timing/update_s`) and the fastest's
(`timing/update_min_s`); the bench reports their medians, the max/min ratio, the step time and
the per-rank token spread the balancer saw (`balance/tokens_*`). Micro-batches hold one group's
worth of sequences, sorted by length (the trainer's default), so a rank's cost follows its tokens.

    .venv/bin/python bench/balance.py                 # tiny + smollm2_135m (if available), 2 processes
    .venv/bin/python bench/balance.py --models tiny --repeats 3 --steps 5
    .venv/bin/python bench/balance.py --smoke --results-dir /tmp/r   # off and on launched at once
"""

from __future__ import annotations

import json
import statistics

import common as C

PREAMBLE = "Read the question carefully; it is about adding two whole numbers, nothing else. "
SETTINGS = {"tiny": dict(prompts_per_rank=4, group_size=4, max_new_tokens=32, lr=1e-5, preamble=3),
            "smollm2_135m": dict(prompts_per_rank=2, group_size=4, max_new_tokens=32, lr=1e-6, preamble=6)}


def skewed_task(path, preamble_repeats: int, rows: int = 64) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            a, b = (7 * i) % 50 + 1, (11 * i) % 50 + 1
            pad = PREAMBLE * preamble_repeats if i % 2 == 0 else ""
            f.write(json.dumps({"prompt": f"{pad}What is {a} + {b}?", "answer": str(a + b)}) + "\n")


def run(model: str, balance: bool, steps: int, s: dict, task, wd, tag: str, nproc: int, engine: str) -> dict:
    out = wd / f"{tag}"
    C.fresh(out)
    overrides = C.distflow_overrides(model, out, steps, s["prompts_per_rank"], s["group_size"], s["max_new_tokens"],
                                     s["lr"], engine, extra=[f"task.path={task}", "data.shuffle=false",
                                                     "rollout.max_prompt_tokens=256",
                                                     f"run.balance_lengths={str(balance).lower()}",
                                                     f"optim.micro_batch_size={s['group_size']}"])
    C.torchrun(C.GRPO, overrides, nproc, wd / f"{tag}.log")
    ms = C.read_metrics(out)[1:]  # step 1 is the warm-up
    rec = {"update_max_s": [m["timing/update_s"] for m in ms], "update_min_s": [m["timing/update_min_s"] for m in ms],
           "step_s": [m["timing/step_s"] for m in ms], "tokens": [C.step_tokens(m) for m in ms]}
    if balance:
        for k in ("tokens_before_max", "tokens_before_min", "tokens_after_max", "tokens_after_min", "moved_groups"):
            rec[k] = [m[f"balance/{k}"] for m in ms]
    return rec


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="runs per setting (default 2; --smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run incl. 1 warm-up (default 4; --smoke: 2)")
    args = p.parse_args()
    repeats, steps = args.repeats or (1 if args.smoke else 2), args.steps or (2 if args.smoke else 4)
    wd = C.work_dir(args, "balance")
    records, rows = [], []
    for model in C.models(args):
        s = dict(SETTINGS[model])
        if args.smoke:  # the skew is in the prompts: fewer of them and shorter completions keep it
            s.update(prompts_per_rank=2, max_new_tokens=8)
        task = wd / f"skewed-{model}.jsonl"
        skewed_task(task, s["preamble"])
        runs = {False: [], True: []}

        def one(balance: bool, r: int) -> dict:
            print(f"[balance] {model} balance={balance} repeat {r}", flush=True)
            return run(model, balance, steps, s, task, wd, f"{model}-{balance}-{r}", args.nproc, C.engine(args))

        for r in range(repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            # --smoke launches off and on at once (their times are not compared, the token spread is)
            for balance, rec in zip(order, C.each(lambda b: one(b, r), order, together=args.smoke)):
                runs[balance].append(rec)
        rec = {"model": model, "processes": args.nproc, "repeats": repeats, "measured_steps": steps - 1,
               "settings": s, "loadavg_1m": C.loadavg()}
        for balance, name in ((False, "off"), (True, "on")):
            flat = {k: [v for run_ in runs[balance] for v in run_[k]] for k in runs[balance][0]}
            mx, mn = statistics.median(flat["update_max_s"]), statistics.median(flat["update_min_s"])
            rec[name] = {"update_max_s_median": mx, "update_min_s_median": mn, "update_max_over_min": mx / mn,
                         "step_s_median": statistics.median(flat["step_s"]),
                         "tokens_per_s": sum(flat["tokens"]) / sum(flat["step_s"]), "raw": flat}
        on = rec["on"]["raw"]
        rec["tokens_spread_before"] = statistics.median(a / max(b, 1) for a, b in
                                                        zip(on["tokens_before_max"], on["tokens_before_min"]))
        rec["tokens_spread_after"] = statistics.median(a / max(b, 1) for a, b in
                                                       zip(on["tokens_after_max"], on["tokens_after_min"]))
        rec["update_max_ratio_on_over_off"] = rec["on"]["update_max_s_median"] / rec["off"]["update_max_s_median"]
        records.append(rec)
        for name in ("off", "on"):
            x = rec[name]
            rows.append([model, name, x["update_max_s_median"], x["update_min_s_median"], x["update_max_over_min"],
                         x["step_s_median"], x["tokens_per_s"],
                         rec["tokens_spread_before" if name == "off" else "tokens_spread_after"]])
    print(C.table(["model", "balance", "update max s", "update min s", "max/min", "step s", "tok/s",
                   "tokens max/min"], rows))
    C.write_json(args.results_dir, "balance", {"bench": "balance", "smoke": args.smoke, "machine": C.machine(),
                                               "records": records})


if __name__ == "__main__":
    main()
